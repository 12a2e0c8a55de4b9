"""Tool-call parsing in the Hermes/Qwen and Llama 3 formats, and the format read from a chat template."""

from __future__ import annotations

import pytest

from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.wire.tool_calls import ToolCall, parse_tool_calls, tool_call_style_for


def test_hermes_calls_content_and_stable_ids():
    text = ('let me compute <tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": 1}"}</tool_call> done')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "let me compute  done"
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "3*4"}), ("lookup", {"key": 1})]
    assert parsed.errors == ()
    ids = [c.call_id for c in parsed.calls]
    assert len(set(ids)) == 2 and ids == [c.call_id for c in parse_tool_calls(text, "hermes").calls]
    assert isinstance(parsed.calls[0], ToolCall)


@pytest.mark.parametrize("body, fragment", [
    ('{"name": "calculator", "arguments": {"expression": }', "not valid JSON"),
    ('{"arguments": {}}', "missing a string 'name'"),
    ('{"name": "calculator", "arguments": [1, 2]}', "arguments must be a JSON object"),
    ('["calculator"]', "expected a JSON object"),
])
def test_hermes_malformed_calls_become_errors_not_exceptions(body, fragment):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert parsed.calls == () and len(parsed.errors) == 1 and fragment in parsed.errors[0]


def test_hermes_unclosed_call_and_plain_answer():
    unclosed = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {}}', "hermes")
    assert unclosed.calls == () and "never closed" in unclosed.errors[0]
    plain = parse_tool_calls("the answer is 12", "hermes")
    assert plain == parse_tool_calls("the answer is 12", "hermes") and plain.content == "the answer is 12"
    assert plain.calls == () and plain.errors == ()


def test_hermes_call_ends_after_its_json_not_at_a_closing_tag_inside_an_argument():
    code = "print('</tool_call>')"
    text = ('run it <tool_call>\n{"name": "python", "arguments": {"code": "' + code + '"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "1"}} trailing</tool_call> then')
    parsed = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("python", {"code": code})]
    assert parsed.errors == ("tool call 1: not valid JSON (text after the JSON value): "
                             "'{\"name\": \"python\", \"arguments\": {\"code\": \"1\"}} trailing'",)
    assert parsed.content == "run it  then"
    broken = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "</tool_call>', "hermes")
    assert broken.calls == () and "Unterminated string" in broken.errors[0]


def test_llama3_json_calls_with_and_without_python_tag():
    one = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1+1"}}<|eom_id|>', "llama3")
    assert [(c.name, c.arguments) for c in one.calls] == [("calculator", {"expression": "1+1"})] and one.content == ""
    two = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 2}}',
                           "llama3")
    assert [(c.name, c.arguments) for c in two.calls] == [("a", {}), ("b", {"x": 2})] and two.errors == ()
    answer = parse_tool_calls("it is 2", "llama3")
    assert answer.content == "it is 2" and answer.calls == () and answer.errors == ()
    broken = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {', "llama3")
    assert broken.calls == () and "not valid JSON" in broken.errors[0]


def test_unknown_style_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'xml'.*\['hermes', 'llama3'\]"):
        parse_tool_calls("x", "xml")


def test_style_comes_from_the_chat_template_or_names_the_setting():
    assert tool_call_style_for(build_tool_chat_tokenizer("qwen")) == "hermes"
    assert tool_call_style_for(build_tool_chat_tokenizer("llama3")) == "llama3"
    with pytest.raises(ValueError, match="tool_call_style"):
        tool_call_style_for(build_char_tokenizer())
