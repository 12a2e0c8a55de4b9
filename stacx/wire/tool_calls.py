"""Tool calls in a model's text, in the two formats chat templates use, and which one a tokenizer speaks.

    parsed = parse_tool_calls(text, tool_call_style_for(tokenizer))
    parsed.content   # the text outside the calls (the answer, or the model's reasoning before a call)
    parsed.calls     # ToolCall(name, arguments, call_id), in order
    parsed.errors    # one message per call the model meant but wrote malformed

Styles:
- "hermes" (Qwen2/2.5/3, Hermes, and templates like them): every call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text outside the tags is content. The
  call is the JSON value after `<tool_call>` (decoded, so a `</tool_call>` inside a string argument,
  `print('</tool_call>')`, is part of it), then the closing tag.
- "llama3" (Llama 3.1-3.3 JSON tool calling): the whole reply is one or more JSON objects
  `{"name": ..., "parameters": {...}}` (`arguments` accepted too), separated by `;` or whitespace,
  optionally after `<|python_tag|>`. A reply that starts otherwise is content, with no calls.

A call whose JSON does not parse, lacks a string `name`, or whose arguments are not an object is
not returned as a call: it becomes an entry of `errors` (the caller shows it to the model as an
error observation and counts it). Parsing never raises on model text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

TOOL_CALL_STYLES = ("hermes", "llama3")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
LLAMA3_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    call_id: str
    """Stable for the same text: `call_<hash of the text>_<index>` (a tool message answers it by this id)."""


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


def parse_tool_calls(text: str, style: str) -> ParsedToolCalls:
    """The content, the well-formed calls and one error per malformed call of `text` (see the module doc)."""
    if style == "hermes":
        return _parse_hermes(text)
    if style == "llama3":
        return _parse_llama3(text)
    raise ValueError(f"tool call style {style!r} is unknown; known styles: {list(TOOL_CALL_STYLES)}")


def tool_call_style_for(tokenizer) -> str:
    """'hermes' or 'llama3', read from the tokenizer's chat template.

    Raises ValueError naming the setting to give instead (`tool_call_style` of the environment or
    of the prompt row's metadata) when the template shows neither format."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the tool-use one renders the calls
        template = template.get("tool_use") or "\n".join(str(t) for t in template.values())
    template = template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if LLAMA3_PYTHON_TAG in template or ("<|start_header_id|>" in template and "ipython" in template):
        return "llama3"
    raise ValueError(
        f"cannot tell the tool-call format of {type(tokenizer).__name__}'s chat template (it mentions neither "
        f"{HERMES_OPEN!r} nor {LLAMA3_PYTHON_TAG!r}/'ipython'); set `tool_call_style` to one of "
        f"{list(TOOL_CALL_STYLES)} on the environment class or in the prompt row's metadata, or use a "
        "checkpoint whose chat template renders tools")


def _call_id(text: str, index: int) -> str:
    return f"call_{hashlib.sha1(text.encode('utf-8', 'replace')).hexdigest()[:10]}_{index}"


def _to_call(payload, text: str, index: int, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a decoded JSON payload, or the error message saying what is wrong with it."""
    if not isinstance(payload, dict):
        return f"tool call {index}: expected a JSON object, got {type(payload).__name__}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call {index}: missing a string 'name'"
    key = next((k for k in argument_keys if k in payload), None)
    arguments = payload.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f"tool call {index} ({name}): arguments are a string that is not JSON: {error}"
    if not isinstance(arguments, dict):
        return f"tool call {index} ({name}): arguments must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, call_id=_call_id(text, index))


def _hermes_block(text: str, start: int, decoder: json.JSONDecoder):
    """The call opened at `text[start:]` (which starts with HERMES_OPEN): (payload or None, error or None,
    where the block ends). The payload is the JSON value after the tag, decoded (its strings may hold
    the closing tag); the block ends after the HERMES_CLOSE that follows it."""
    body = start + len(HERMES_OPEN)
    while body < len(text) and text[body].isspace():
        body += 1
    close = text.find(HERMES_CLOSE, body)
    try:
        payload, end = decoder.raw_decode(text, body)
    except json.JSONDecodeError as error:
        if close < 0:
            return None, f"{HERMES_OPEN} is never closed by {HERMES_CLOSE}", len(text)
        return None, f"not valid JSON ({error}): {text[body:close].strip()[:200]!r}", close + len(HERMES_CLOSE)
    rest = end
    while rest < len(text) and text[rest].isspace():
        rest += 1
    if text.startswith(HERMES_CLOSE, rest):
        return payload, None, rest + len(HERMES_CLOSE)
    close = text.find(HERMES_CLOSE, end)
    if close < 0:
        return None, f"{HERMES_OPEN} is never closed by {HERMES_CLOSE}", len(text)
    return None, f"not valid JSON (text after the JSON value): {text[body:close].strip()[:200]!r}", \
        close + len(HERMES_CLOSE)


def _parse_hermes(text: str) -> ParsedToolCalls:
    decoder, calls, errors, content, position, index = json.JSONDecoder(), [], [], [], 0, 0
    while (start := text.find(HERMES_OPEN, position)) >= 0:
        content.append(text[position:start])
        payload, error, position = _hermes_block(text, start, decoder)
        if error is not None:
            errors.append(f"tool call {index}: {error}")
        else:
            parsed = _to_call(payload, text, index, ("arguments", "parameters"))
            (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        index += 1
    content.append(text[position:])
    return ParsedToolCalls(content="".join(content).strip(), calls=tuple(calls), errors=tuple(errors))


def _parse_llama3(text: str) -> ParsedToolCalls:
    body = text.strip()
    for end in LLAMA3_END_TOKENS:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(LLAMA3_PYTHON_TAG)
    body = body.removeprefix(LLAMA3_PYTHON_TAG).strip()
    if not tagged and not re.match(r'\{\s*"name"', body):
        return ParsedToolCalls(content=text.strip(), calls=(), errors=())
    decoder, calls, errors, position, index = json.JSONDecoder(), [], [], 0, 0
    while position < len(body):
        try:
            payload, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError as error:
            errors.append(f"tool call {index}: not valid JSON ({error}): {body[position:position + 200]!r}")
            break
        parsed = _to_call(payload, text, index, ("parameters", "arguments"))
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        index += 1
        position = end
        while position < len(body) and body[position] in "; \n\t":
            position += 1
    return ParsedToolCalls(content="", calls=tuple(calls), errors=tuple(errors))
