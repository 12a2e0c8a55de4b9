"""Tool calls in a model's text: parsed into (content, calls, errors).

    parsed = parse_tool_calls(text, tool_call_style_for(tokenizer))
    parsed.content        # the text around the calls
    parsed.calls          # (ToolCall(name, arguments: dict, call_id), ...)
    parsed.errors         # one message per call block that could not be read

One style so far, Hermes (Qwen 2.5/3, Hermes, many others): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. A block that is not
such an object is reported in `errors` and left out of `calls` (its text stays out of `content`
too), so one malformed call never hides the others.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedToolCalls", "ToolCall", "TOOL_CALL_STYLES", "parse_tool_calls", "tool_call_style_for"]

TOOL_CALL_STYLES = ("hermes",)
"""The styles `parse_tool_calls` reads."""

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    """The id a tool's answer refers to (OpenAI's `tool_call_id`)."""


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str
    """The text outside the call blocks, stripped."""
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()
    """One message per block that is not a call (bad JSON, no name, arguments not an object)."""


def tool_call_style_for(tokenizer: Any) -> str:
    """The tool-call style of `tokenizer`'s chat template: "hermes" (the only one read so far; a
    template that renders no `<tool_call>` markup still gets it, the common default)."""
    return "hermes"


def parse_tool_calls(text: str, style: str) -> ParsedToolCalls:
    """Split `text` into content and tool calls written in `style` (one of TOOL_CALL_STYLES)."""
    if style not in TOOL_CALL_STYLES:
        raise ValueError(f"parse_tool_calls: unknown tool-call style {style!r}; known: {list(TOOL_CALL_STYLES)}")
    calls, errors = [], []
    for index, match in enumerate(_HERMES_BLOCK.finditer(text)):
        call, error = _read_call(match.group(1), index)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    content = _HERMES_BLOCK.sub("", text).strip()
    return ParsedToolCalls(content=content, calls=tuple(calls), errors=tuple(errors))


def _read_call(body: str, index: int) -> tuple[ToolCall | None, str]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return None, f"tool call {index}: not JSON ({err.msg} at character {err.pos}): {body.strip()[:80]!r}"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None, f'tool call {index}: expected {{"name": <string>, "arguments": {{...}}}}, got {body.strip()[:80]!r}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, f"tool call {index} ({value['name']}): 'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return None, f"tool call {index} ({value['name']}): 'arguments' must be an object, got {type(arguments).__name__}"
    return ToolCall(name=value["name"], arguments=arguments), ""
