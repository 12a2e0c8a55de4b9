"""Anthropic's Messages format translated to the OpenAI chat form, answers and event streams rendered, stop
strings cut token-exactly (pure functions, no server)."""

import json

import pytest

from stacx.serving.anthropic_protocol import (
    error_body,
    message_events,
    parse_messages_request,
    render_message,
    server_sent_events,
)
from stacx.serving.stop_sequences import cut_at_stop_sequences
from stacx.wire.tool_calls import ParsedToolCalls, ToolCall
from stacx.wire.types import GenerateOutput

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}


def test_a_tool_use_conversation_becomes_the_openai_chat_form():
    body = {
        "model": "policy", "max_tokens": 64, "system": [{"type": "text", "text": "You run "},
                                                         {"type": "text", "text": "bash.", "cache_control": {}}],
        "tools": [{"name": "bash", "description": "run a command", "input_schema": SCHEMA, "cache_control": {}}],
        "messages": [
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": [{"type": "text", "text": "Listing."},
                                              {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}},
                                              {"type": "tool_use", "id": "t2", "name": "bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"},
                                         {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                          "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "args"}]},
                                         {"type": "text", "text": "now read it"}]},
            {"role": "system", "content": "Agents available: none."},
        ],
        "stop_sequences": ["\nUser:"], "temperature": 0, "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"},
        # what a Claude-Code-style CLI adds: context edits that change nothing here, an effort level
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }
    request = parse_messages_request(body)
    assert request.messages == [
        {"role": "system", "content": "You run bash."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
            {"id": "t2", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "t2", "content": "no args"},
        {"role": "user", "content": "now read it"},
        {"role": "system", "content": "Agents available: none."},
    ]
    assert request.tools == [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                                               "parameters": SCHEMA}}]
    assert request.sampling.max_tokens == 64 and request.sampling.temperature == 0.0
    assert request.stop_sequences == ("\nUser:",) and not request.stream and request.use_tools
    assert not parse_messages_request({**body, "tool_choice": {"type": "none"}}).use_tools


@pytest.mark.parametrize("change, named", [
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"top_k": 5}, "'top_k' is not supported"),
    ({"temperature": 1.5}, "'temperature' must be a number in [0, 1]"),
    ({"frobnicate": 1}, "unsupported fields ['frobnicate']"),
    ({"tool_choice": {"type": "any"}}, "'tool_choice' {\"type\": \"any\"} is not supported"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "'output_config.format' (structured outputs)"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'tools[0]' is a 'web_search_20250305' tool"),
    ({"tools": [{"name": "bash"}]}, "'tools[0]' must have a string 'name' and an object 'input_schema'"),
    ({"stop_sequences": [""]}, "'stop_sequences' must be a list of non-empty strings"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "'messages[0].role' must be \"user\", \"assistant\" or"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "'context_management.edits[0]' of type 'clear_tool_uses_20250919' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'messages[0].content[0].type' must be one of ['text', 'tool_result']"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "bash", "input": {}}]},
                   {"role": "user", "content": "go on"}]},
     "'messages[0].content[0]' must be a tool_use block"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "'messages[0].content[0].tool_use_id' must be the id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]},
     "'messages[1]' is an assistant message (a prefill)"),
])
def test_a_request_this_server_cannot_honour_is_refused_naming_the_field(change, named):
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(ValueError, match="^/v1/messages: ") as refused:
        parse_messages_request({k: v for k, v in body.items() if v is not None})
    assert named in str(refused.value)


def test_count_tokens_takes_no_max_tokens_and_refuses_sampling_fields():
    endpoint = "/v1/messages/count_tokens"
    counted = parse_messages_request({"messages": [{"role": "user", "content": "hi"}]}, endpoint=endpoint)
    assert counted.messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="unsupported fields \\['max_tokens'\\]"):
        parse_messages_request({"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}, endpoint=endpoint)


def _output(ids, finish="stop"):
    return GenerateOutput(output_ids=list(ids), output_log_probs=[-0.5] * len(ids), finish_reason=finish,
                          output_token_versions=[3] * len(ids), weight_version=3)


def test_the_answer_and_its_event_stream_carry_the_same_message():
    calls = (ToolCall(name="bash", arguments={"command": "x" * 100}, call_id="call_1_0"),)
    parsed = ParsedToolCalls(content="I will look. " * 9, calls=calls, errors=())
    message = render_message(_output(range(7)), parsed, stop_sequence=None, num_prompt_tokens=11, model="policy")
    assert message["content"] == [{"type": "text", "text": "I will look. " * 9},
                                  {"type": "tool_use", "id": "call_1_0", "name": "bash", "input": {"command": "x" * 100}}]
    assert message["stop_reason"] == "tool_use" and message["usage"]["input_tokens"] == 11
    assert message["stacx"] == {"weight_version": 3, "output_token_ids": list(range(7))}

    events = message_events(message)
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    # Accumulated as a client does, the deltas give back the blocks.
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["index"] == 0)
    arguments = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == 1)
    assert text == message["content"][0]["text"] and json.loads(arguments) == {"command": "x" * 100}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stacx"] == message["stacx"]
    wire = server_sent_events(events[-1:]).decode()
    assert wire == 'event: message_stop\ndata: {"type": "message_stop"}\n\n'


@pytest.mark.parametrize("finish, stop, expected", [("length", None, "max_tokens"), ("stop", None, "end_turn"),
                                                    ("stop", "\n\n", "stop_sequence")])
def test_stop_reason(finish, stop, expected):
    message = render_message(_output([1, 2], finish), ParsedToolCalls(content="hi", calls=(), errors=()),
                             stop_sequence=stop, num_prompt_tokens=1, model="m")
    assert (message["stop_reason"], message["stop_sequence"]) == (expected, stop)


def test_errors_follow_anthropics_schema():
    assert error_body(400, "bad") == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert error_body(503, "busy")["error"]["type"] == "overloaded_error"
    assert error_body(500, "boom")["error"]["type"] == "api_error"


PIECES = ["Let", " me", " see", "\nOb", "serv", "ation", ":", " more", "\nObservation:", " end"]


def _decode(ids):
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize("stops, kept, text", [
    (["\nObservation:"], 7, "Let me see"),            # the stop string spans four tokens
    (["ation:", "see"], 3, "Let me "),                 # the first to complete wins
    ([" mo", "absent"], 8, "Let me see\nObservation:"),   # the string ends inside a token: that token is kept
    (["absent"], 10, "".join(PIECES)),
])
def test_a_stop_string_cuts_the_output_after_the_token_that_completes_it(stops, kept, text):
    output = _output(range(len(PIECES)), finish="length")
    cut = cut_at_stop_sequences(output, stops, _decode)
    assert cut.output.output_ids == list(range(kept)) and cut.text == text
    assert cut.output.output_log_probs == [-0.5] * kept and cut.output.output_token_versions == [3] * kept
    assert cut.output.finish_reason == ("length" if kept == len(PIECES) else "stop")
    assert cut.stop_sequence == (None if kept == len(PIECES) else next(s for s in stops if s in _decode(range(kept))))
