"""OpenAI's `/v1/chat/completions` and `/v1/completions` wire format: request checks and answers.

Pure functions used by `stacx serve`'s OpenAI-compatible endpoint (openai_endpoints.py). The subset:

- chat: `messages` (system, user, assistant with `tool_calls`, tool), `tools` (function tools, given
  to the chat template), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`,
  `logprobs` + `top_logprobs` (0 only), `n` (1 only), `tool_choice` "auto" / "none";
- completions: `prompt` (a string, a one-string list, or token ids), the same sampling fields,
  `logprobs` (an integer; 0 gives the sampled tokens' log-probs only), `echo` false.

Fields that change nothing here are accepted and ignored (`user`, `stream: false`, zero penalties,
`parallel_tool_calls`, `metadata`, `store`); a field this server cannot honour (`stop` strings,
`stream: true`, `n > 1`, non-zero penalties, `logit_bias`) is a ValueError naming it, never silently
dropped. Answers carry OpenAI's fields plus `stacx: {weight_version, output_token_ids}`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from stacx.rollout.tool_calls import ParsedToolCalls
from stacx.rollout.types import GenerateOutput

__all__ = ["ChatRequest", "CompletionRequest", "OpenAISampling", "parse_chat_request", "parse_completion_request",
           "render_chat_response", "render_completion_response", "template_messages"]

_IGNORED = {"model", "user", "stream", "parallel_tool_calls", "metadata", "store", "presence_penalty",
            "frequency_penalty", "stream_options", "service_tier"}
_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "logit_bias"}
_CHAT = _IGNORED | _SAMPLING | {"messages", "tools", "tool_choice", "logprobs", "top_logprobs"}
_COMPLETION = _IGNORED | _SAMPLING | {"prompt", "logprobs", "echo", "suffix", "best_of"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class OpenAISampling:
    max_tokens: Optional[int]
    """None: what the server's default and the model's context leave."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    messages: list[dict]
    """As sent (the session book compares them with the previous turn's)."""
    tools: Optional[list[dict]]
    sampling: OpenAISampling
    logprobs: bool = False
    use_tools: bool = True
    """False for tool_choice "none": the template still sees the tools, the answer has no calls."""


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: OpenAISampling
    logprobs: bool = False


def _fail(endpoint: str, message: str) -> None:
    raise ValueError(f"{endpoint}: {message}")


def _check_fields(body: Any, known: set, endpoint: str) -> dict:
    if not isinstance(body, dict):
        _fail(endpoint, "body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        _fail(endpoint, f"unsupported fields {unknown}; supported: {sorted(known)}")
    if body.get("stream") not in (None, False):
        _fail(endpoint, "'stream': true is not supported; send stream false (the default)")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            _fail(endpoint, f"'{key}' must be 0 (penalties would change the trained log-probs), got {body[key]!r}")
    if body.get("logit_bias"):
        _fail(endpoint, "'logit_bias' is not supported (it would change the trained log-probs)")
    if body.get("stop"):
        _fail(endpoint, f"'stop' strings are not supported, got {body['stop']!r}; generation stops at the "
                        "model's end-of-turn token or max_tokens")
    if body.get("n") not in (None, 1):
        _fail(endpoint, f"'n' must be 1 (send one request per sample), got {body['n']!r}")
    return body


def _number(body: dict, key: str, endpoint: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        _fail(endpoint, f"'{key}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, key: str, endpoint: str, minimum: int) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(endpoint, f"'{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _sampling(body: dict, endpoint: str) -> OpenAISampling:
    max_tokens = _integer(body, "max_completion_tokens", endpoint, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", endpoint, 1)
    top_p = _number(body, "top_p", endpoint, 1.0, 0.0, 1.0)
    if top_p == 0.0:
        _fail(endpoint, "'top_p' must be > 0")
    return OpenAISampling(max_tokens=max_tokens, temperature=_number(body, "temperature", endpoint, 1.0, 0.0, 2.0),
                          top_p=top_p, seed=_integer(body, "seed", endpoint, 0))


def _text_of(content: Any, where: str, endpoint: str) -> str:
    """A message's content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                _fail(endpoint, f"'{where}.content[{index}]' must be a text part {{\"type\": \"text\", \"text\": ...}} "
                                "(this server reads text only)")
            parts.append(part["text"])
        return "".join(parts)
    _fail(endpoint, f"'{where}.content' must be a string, null or a list of text parts")


def _check_messages(messages: Any, endpoint: str) -> None:
    if not isinstance(messages, list) or not messages:
        _fail(endpoint, "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            _fail(endpoint, f"'{where}.role' must be one of {list(_ROLES)}, got "
                            f"{message.get('role') if isinstance(message, dict) else message!r}")
        _text_of(message.get("content"), where, endpoint)
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if message["role"] != "assistant" or not isinstance(calls, list):
            _fail(endpoint, f"'{where}.tool_calls' must be a list, on an assistant message")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                _fail(endpoint, f"'{where}.tool_calls[{j}].function.name' must be a string")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    _fail(endpoint, f"'{where}.tool_calls[{j}].function.arguments' is not JSON: {arguments[:80]!r}")


def parse_chat_request(body: Any) -> ChatRequest:
    """A `/v1/chat/completions` body -> ChatRequest; ValueError naming the field on a mistake."""
    endpoint = "/v1/chat/completions"
    body = _check_fields(body, _CHAT, endpoint)
    _check_messages(body.get("messages"), endpoint)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            _fail(endpoint, "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}} objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
        _fail(endpoint, f"'tool_choice' must be \"auto\" or \"none\", got {choice!r}")
    if choice == "required" or isinstance(choice, dict):
        _fail(endpoint, f"'tool_choice' {choice!r} is not supported (the model is not constrained); use \"auto\"")
    if body.get("logprobs") not in (None, True, False):
        _fail(endpoint, f"'logprobs' must be true or false, got {body['logprobs']!r}")
    if body.get("top_logprobs") not in (None, 0):
        _fail(endpoint, f"'top_logprobs' must be 0 (the sampled tokens' log-probs only), got {body['top_logprobs']!r}")
    return ChatRequest(messages=body["messages"], tools=tools or None, sampling=_sampling(body, endpoint),
                       logprobs=bool(body.get("logprobs")), use_tools=choice != "none")


def parse_completion_request(body: Any) -> CompletionRequest:
    """A `/v1/completions` body -> CompletionRequest; ValueError naming the field on a mistake."""
    endpoint = "/v1/completions"
    body = _check_fields(body, _COMPLETION, endpoint)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    token_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not token_ids:
        _fail(endpoint, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)")
    if body.get("echo"):
        _fail(endpoint, "'echo': true is not supported")
    if body.get("suffix") or body.get("best_of") not in (None, 1):
        _fail(endpoint, "'suffix' and 'best_of' > 1 are not supported")
    logprobs = _integer(body, "logprobs", endpoint, 0)
    if logprobs not in (None, 0):
        _fail(endpoint, f"'logprobs' must be 0 (the sampled tokens' log-probs only), got {logprobs}")
    return CompletionRequest(prompt=prompt, sampling=_sampling(body, endpoint), logprobs=logprobs is not None)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: content as one string, tool-call arguments as objects
    (OpenAI sends them as JSON strings; Hugging Face templates expect mappings)."""
    out = []
    for message in messages:
        rendered = dict(message, content=_text_of(message.get("content"), "message", "template"))
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = json.loads(function["arguments"] or "{}")
                calls.append({**call, "function": function})
            rendered["tool_calls"] = calls
        out.append(rendered)
    return out


def _finish_reason(output: GenerateOutput, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if output.finish_reason == "length" else "stop"


def _usage(num_prompt: int, output: GenerateOutput) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": len(output.output_ids),
            "total_tokens": num_prompt + len(output.output_ids)}


def _stacx_fields(output: GenerateOutput) -> dict:
    return {"weight_version": output.weight_version, "output_token_ids": list(output.output_ids)}


def render_chat_response(output: GenerateOutput, parsed: ParsedToolCalls, *, num_prompt_tokens: int, model: str,
                         token_texts: Optional[list[str]]) -> dict:
    """A `chat.completion` object; `token_texts` (one per output id) when log-probs were asked for."""
    message: dict = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls else None}
    if parsed.calls:
        message["tool_calls"] = [{"id": call.call_id, "type": "function",
                                  "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                 for call in parsed.calls]
    logprobs = None
    if token_texts is not None:
        logprobs = {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                                for text, lp in zip(token_texts, output.output_log_probs)]}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": f"weights-v{output.weight_version}",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": _finish_reason(output, bool(parsed.calls))}],
            "usage": _usage(num_prompt_tokens, output), "stacx": _stacx_fields(output)}


def render_completion_response(output: GenerateOutput, text: str, *, num_prompt_tokens: int, model: str,
                               token_texts: Optional[list[str]]) -> dict:
    """A `text_completion` object; `token_texts` (one per output id) when log-probs were asked for."""
    logprobs = None
    if token_texts is not None:
        offsets, at = [], 0
        for piece in token_texts:
            offsets.append(at)
            at += len(piece)
        logprobs = {"tokens": token_texts, "token_logprobs": list(output.output_log_probs), "top_logprobs": None,
                    "text_offset": offsets}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": f"weights-v{output.weight_version}",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": _finish_reason(output, False)}],
            "usage": _usage(num_prompt_tokens, output), "stacx": _stacx_fields(output)}
