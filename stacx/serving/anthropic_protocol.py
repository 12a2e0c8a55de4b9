"""Anthropic's Messages API (`/v1/messages`) wire format, translated to and from the OpenAI chat form.

Pure functions used by `stacx serve`'s Anthropic adapter (anthropic_endpoints.py). A request
becomes the same OpenAI-style chat messages and function tools that `/v1/chat/completions` gets, so
both APIs share the chat template, the session's token-in/token-out prompts, generation and the
recorded turns (openai_sessions.py): a conversation gives the same ids through either.

Request -> chat messages:
  system (a string or text blocks)             -> {"role": "system"} (first; system messages within
                                                  `messages` stay where they are)
  user text blocks                             -> {"role": "user", "content": the texts joined}
  user tool_result blocks                      -> {"role": "tool", "tool_call_id": tool_use_id, "content"}
  assistant text + tool_use blocks             -> {"role": "assistant", "content", "tool_calls": [...]}
  tools [{name, description, input_schema}]    -> [{"type": "function", "function": {name, description, parameters}}]

Blocks keep their order (text after tool results becomes a user message after the tool messages).
Read: `max_tokens` (required), `temperature`, `top_p` (recent SDKs send them only through
`extra_body`), `stop_sequences`, `stream`, `tool_choice` auto / none; accepted and ignored: `model`,
`metadata`, `thinking` (the served model's text comes back as text blocks), `output_config.effort`,
`context_management` clear_thinking edits, `cache_control` (top-level, on blocks and tools),
`service_tier`, `speed`, `inference_geo`, `diagnostics`, `user_profile_id`, `workspace_id`, `is_error`
on tool results. Refused with a 400 naming the field, never dropped: other fields, `top_k`,
`tool_choice` any / tool, `output_config.format`, `container`, other context edits, image and
document blocks, Anthropic-hosted tools, a last assistant message (a prefill: the template would
close it and open a new reply).

Answer: a `message` whose content is a text block (when the reply has text) and one `tool_use`
block per parsed call (its id is the OpenAI path's call id), `stop_reason` tool_use / stop_sequence /
max_tokens / end_turn, `usage`, and `stacx: {weight_version, output_token_ids}`; streamed as
Anthropic's server-sent events (`message_events`). Errors: `{"type": "error", "error": {type, message}}`.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from stacx.serving.openai_protocol import OpenAISampling
from stacx.wire.tool_calls import ParsedToolCalls
from stacx.wire.types import GenerateOutput

__all__ = ["MessagesRequest", "error_body", "message_events", "parse_messages_request", "render_message",
           "server_sent_events"]

_IGNORED = {"model", "metadata", "service_tier", "stream", "thinking", "cache_control", "diagnostics", "inference_geo",
            "speed", "user_profile_id", "workspace_id"}
"""Fields that change nothing here (prompt caching, routing, accounting, the thinking budget)."""
_MESSAGES = _IGNORED | {"messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                        "tools", "tool_choice", "output_config", "container", "context_management"}
_COUNT_TOKENS = _MESSAGES - {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k"}
_TEXT_BLOCK = "{\"type\": \"text\", \"text\": ...}"
TEXT_DELTA_CHARS = 64
"""Characters per `text_delta` event (the reply is sent once generated; see anthropic_endpoints)."""
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 411: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
"""Anthropic's error type per HTTP status; any other status is "api_error"."""


@dataclass(frozen=True, kw_only=True)
class MessagesRequest:
    messages: list[dict]
    """The conversation as OpenAI-style chat messages (what `/v1/chat/completions` would be sent)."""
    tools: Optional[list[dict]]
    """The tools as OpenAI function tools; None when none."""
    sampling: OpenAISampling
    stop_sequences: tuple[str, ...] = ()
    """Strings that end the reply (cut after generation: stop_sequences.py)."""
    stream: bool = False
    """Answer as server-sent events."""
    use_tools: bool = True
    """False for tool_choice none: the template still sees the tools, the answer has no tool_use blocks."""


def _fail(endpoint: str, message: str) -> None:
    raise ValueError(f"{endpoint}: {message}")


def parse_messages_request(body: Any, *, endpoint: str = "/v1/messages") -> MessagesRequest:
    """A `/v1/messages` body (or, with endpoint `/v1/messages/count_tokens`, that one's) ->
    MessagesRequest; ValueError naming the field on a mistake."""
    counting = endpoint.endswith("count_tokens")
    if not isinstance(body, dict):
        _fail(endpoint, "body must be a JSON object")
    known = _COUNT_TOKENS if counting else _MESSAGES
    unknown = sorted(set(body) - known)
    if unknown:
        _fail(endpoint, f"unsupported fields {unknown}; supported: {sorted(known)}")
    if body.get("container") is not None:
        _fail(endpoint, "'container' is not supported (this server runs no code execution containers)")
    output_config = body.get("output_config") or {}
    if not isinstance(output_config, dict) or output_config.get("format") is not None:
        _fail(endpoint, "'output_config.format' (structured outputs) is not supported: the model is not constrained "
                        "to a schema; leave it out ('output_config.effort' is accepted and ignored)")
    for index, edit in enumerate((body.get("context_management") or {}).get("edits") or ()):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not (isinstance(kind, str) and kind.startswith("clear_thinking")):
            _fail(endpoint, f"'context_management.edits[{index}]' of type {kind!r} is not supported (the server "
                            "would have to edit the conversation, and the trained ids with it); clear_thinking edits "
                            "are accepted (the served model's replies hold no thinking blocks)")
    if body.get("top_k") is not None:
        _fail(endpoint, f"'top_k' is not supported (got {body['top_k']!r}); leave it out, use temperature and top_p")
    if body.get("stream") not in (None, True, False):
        _fail(endpoint, f"'stream' must be true or false, got {body['stream']!r}")
    max_tokens = body.get("max_tokens")
    if not counting and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        _fail(endpoint, f"'max_tokens' is required: an integer >= 1, got {max_tokens!r}")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        _fail(endpoint, f"'stop_sequences' must be a list of non-empty strings, got {stops!r}")
    sampling = OpenAISampling(max_tokens=max_tokens, temperature=_number(body, "temperature", endpoint),
                              top_p=_number(body, "top_p", endpoint))
    if sampling.top_p == 0.0:
        _fail(endpoint, "'top_p' must be > 0")
    messages = _system_messages(body.get("system"), endpoint) + _chat_messages(body.get("messages"), endpoint)
    return MessagesRequest(messages=messages, tools=_tools(body.get("tools"), endpoint), sampling=sampling,
                           stop_sequences=tuple(stops), stream=bool(body.get("stream")),
                           use_tools=_tool_choice(body.get("tool_choice"), endpoint) != "none")


def _number(body: dict, key: str, endpoint: str) -> float:
    value = body.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        _fail(endpoint, f"'{key}' must be a number in [0, 1], got {value!r}")
    return float(value)


def _texts(content: Any, where: str, endpoint: str) -> str:
    """A string, or text blocks joined; anything else (images, documents) is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(endpoint, f"'{where}' must be a string or a list of text blocks {_TEXT_BLOCK}")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            _fail(endpoint, f"'{where}[{index}]' must be a text block {_TEXT_BLOCK}, got {kind!r} "
                            "(this server reads text only)")
    return "".join(block["text"] for block in content)


def _system_messages(system: Any, endpoint: str) -> list[dict]:
    if system is None:
        return []
    text = _texts(system, "system", endpoint)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(messages: Any, endpoint: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        _fail(endpoint, "'messages' must be a non-empty list of {\"role\": \"user\" | \"assistant\", \"content\"} "
                        "objects")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            _fail(endpoint, f"'{where}.role' must be \"user\", \"assistant\" or \"system\", got {role!r}")
        content = message.get("content")
        if role == "system":  # a system message within the conversation (Claude Code sends them)
            out.append({"role": "system", "content": _texts(content, f"{where}.content", endpoint)})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += (_user_messages if role == "user" else _assistant_messages)(content, f"{where}.content", endpoint)
        else:
            _fail(endpoint, f"'{where}.content' must be a string or a list of content blocks")
    if messages[-1].get("role") == "assistant":
        _fail(endpoint, f"'messages[{len(messages) - 1}]' is an assistant message (a prefill): this server does not "
                        "continue a partial reply; end the conversation with a user message")
    return out


def _blocks(blocks: list, where: str, endpoint: str, allowed: tuple[str, ...]) -> Iterator[tuple[str, str, dict]]:
    """(path of the block in the request, its type, the block) for each of `blocks`, its type checked against
    `allowed` and a text block's text checked to be a string."""
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            _fail(endpoint, f"'{at}.type' must be one of {list(allowed)} in this message, got {kind!r} "
                            "(this server reads text, tool_use and tool_result blocks)")
        if kind == "text" and not isinstance(block.get("text"), str):
            _fail(endpoint, f"'{at}.text' must be a string")
        yield at, kind, block


def _user_messages(blocks: list, where: str, endpoint: str) -> list[dict]:
    """Tool results become tool messages, runs of text one user message, in the blocks' order."""
    out, texts = [], []
    for at, kind, block in _blocks(blocks, where, endpoint, ("text", "tool_result")):
        if kind == "text":
            texts.append(block["text"])
            continue
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts = []
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            _fail(endpoint, f"'{at}.tool_use_id' must be the id of the tool_use block it answers")
        result = block.get("content")
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                    "content": "" if result is None else _texts(result, f"{at}.content", endpoint)})
    if texts or not blocks:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_messages(blocks: list, where: str, endpoint: str) -> list[dict]:
    """One assistant message: its text blocks joined as content, its tool_use blocks as tool calls."""
    texts, calls = [], []
    for at, kind, block in _blocks(blocks, where, endpoint, ("text", "tool_use")):
        if kind == "tool_use":
            calls.append(_tool_call(block, at, endpoint))
        else:
            texts.append(block["text"])
    message = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool_call(block: dict, at: str, endpoint: str) -> dict:
    """A tool_use block as an OpenAI tool call."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input", {}), dict):
        _fail(endpoint, f"'{at}' must be a tool_use block {{\"id\": str, \"name\": str, \"input\": object}}")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}}


def _tools(tools: Any, endpoint: str) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        _fail(endpoint, "'tools' must be a list of {\"name\", \"description\", \"input_schema\"} objects")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            _fail(endpoint, f"'{where}' is a {kind!r} tool; this server serves custom tools only "
                            "({\"name\", \"description\", \"input_schema\"}), not Anthropic-hosted ones")
        if not isinstance(tool.get("name"), str) or not tool["name"] or not isinstance(tool.get("input_schema"), dict):
            _fail(endpoint, f"'{where}' must have a string 'name' and an object 'input_schema'")
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(choice: Any, endpoint: str) -> str:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None:
        return "auto"
    if kind in ("auto", "none"):
        return kind
    if kind in ("any", "tool"):
        _fail(endpoint, f"'tool_choice' {{\"type\": \"{kind}\"}} is not supported (the model is not constrained "
                        "to call a tool); use {\"type\": \"auto\"}")
    _fail(endpoint, f"'tool_choice' must be {{\"type\": \"auto\" | \"none\"}}, got {choice!r}")


# ---- answers --------------------------------------------------------------------------------------


def stop_reason(output: GenerateOutput, parsed: ParsedToolCalls, stop_sequence: Optional[str]) -> str:
    if parsed.calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if output.finish_reason == "length" else "end_turn"


def render_message(output: GenerateOutput, parsed: ParsedToolCalls, *, stop_sequence: Optional[str],
                   num_prompt_tokens: int, model: str) -> dict:
    """A Messages API `message` (see the module doc)."""
    content = [{"type": "text", "text": parsed.content}] if parsed.content else []
    content += [{"type": "tool_use", "id": call.call_id, "name": call.name, "input": call.arguments}
                for call in parsed.calls]
    reason = stop_reason(output, parsed, stop_sequence)
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason,
            "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
            "usage": {"input_tokens": num_prompt_tokens, "output_tokens": len(output.output_ids),
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            "stacx": {"weight_version": output.weight_version, "output_token_ids": list(output.output_ids)}}


def message_events(message: dict) -> list[tuple[str, dict]]:
    """A finished `message` as Anthropic's stream: message_start, per block content_block_start,
    content_block_delta (text_delta / input_json_delta) and content_block_stop, message_delta
    (stop_reason, output tokens), message_stop. Accumulated, the events give back `message`."""
    usage = message["usage"]
    start = dict(message, content=[], stop_reason=None, stop_sequence=None, usage=dict(usage, output_tokens=0))
    events = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            opening, kind, key, payload = {"type": "text", "text": ""}, "text_delta", "text", block["text"]
        else:
            opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            kind, key, payload = "input_json_delta", "partial_json", json.dumps(block["input"])
        events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": opening}))
        for at in range(0, len(payload), TEXT_DELTA_CHARS):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": kind, key: payload[at:at + TEXT_DELTA_CHARS]}}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": message["stop_reason"],
                                               "stop_sequence": message["stop_sequence"]},
                                     "usage": {"output_tokens": usage["output_tokens"]}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def server_sent_events(events: list[tuple[str, dict]]) -> bytes:
    """`event: NAME` / `data: JSON` pairs, each ended by a blank line."""
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
