"""OpenAI's `/v1/chat/completions` and `/v1/completions` wire format: request checks and answers.

Pure functions used by `stacx serve`'s OpenAI-compatible endpoint (openai_endpoints.py). The subset:

- chat: `messages` (system, user, assistant with `tool_calls`, tool), `tools` (function tools, given
  to the chat template), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`,
  `n`, `stop`, `stream` (+ `stream_options.include_usage`), `logprobs` + `top_logprobs` (0-20),
  `tool_choice` "auto" / "none" / "required" / {"type": "function", "function": {"name"}};
- completions: `prompt` (a string, a one-string list, or token ids), the same sampling fields,
  `logprobs` (an integer 0-20: the sampled tokens' log-probs and that many most likely tokens), `echo` false.

Fields that change nothing here are accepted and ignored (`user`, zero penalties,
`parallel_tool_calls`, `metadata`, `store`); a field this server cannot honour (non-zero penalties,
`logit_bias`, `echo`, `suffix`, `best_of > 1`) is a ValueError naming it, never silently dropped.
Answers carry OpenAI's fields, vLLM's `stop_reason` per choice, and `stacx: {weight_version,
output_token_ids}` (the first choice's, at the top; each choice's own in the choice).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from stacx.serving.openai_stop import parse_stop
from stacx.wire.sglang_protocol import INT_MAX, SEED_MAX
from stacx.wire.tool_calls import ParsedToolCalls
from stacx.wire.types import GenerateOutput

__all__ = ["ChatRequest", "Choice", "CompletionRequest", "OpenAISampling", "ToolChoice", "parse_chat_request",
           "parse_completion_request", "render_chat_response", "render_completion_response", "template_messages"]

MAX_N = 64
"""Most samples one request may ask for (`n`)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position (`top_logprobs`, completions' `logprobs`): OpenAI's and vLLM's default limit."""

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
    n: int = 1
    """Samples of the one prompt; sample i uses seed + i when a seed is given (vLLM's parallel sampling)."""
    stop: tuple[str, ...] = ()
    """Stop strings (openai_stop.py)."""


@dataclass(frozen=True, kw_only=True)
class ToolChoice:
    mode: str = "auto"
    """"auto" (the model decides), "none" (no calls parsed), "required" (a call is forced), "function"
    (a call of `name` is forced): openai_tool_choice.py says how."""
    name: Optional[str] = None
    """The function of mode "function"."""


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    messages: list[dict]
    """As sent (the session book compares them with the previous turn's)."""
    tools: Optional[list[dict]]
    sampling: OpenAISampling
    logprobs: bool = False
    top_logprobs: int = 0
    """Most likely tokens per position in the answer's log-probs (the engine's top-k)."""
    tool_choice: ToolChoice = ToolChoice()
    stream: bool = False
    include_usage: bool = False
    """stream_options.include_usage: a last chunk carries the usage."""

    @property
    def use_tools(self) -> bool:
        """False for tool_choice "none": the template still sees the tools, the answer has no calls."""
        return self.tool_choice.mode != "none"


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: OpenAISampling
    logprobs: bool = False
    top_logprobs: int = 0
    """`logprobs: N`: the N most likely tokens per position."""
    stream: bool = False
    include_usage: bool = False


def _fail(endpoint: str, message: str) -> None:
    raise ValueError(f"{endpoint}: {message}")


def _check_fields(body: Any, known: set, endpoint: str) -> dict:
    if not isinstance(body, dict):
        _fail(endpoint, "body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        _fail(endpoint, f"unsupported fields {unknown}; supported: {sorted(known)}")
    if body.get("stream") not in (None, True, False):
        _fail(endpoint, f"'stream' must be true or false, got {body['stream']!r}")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage",
                                                                                "continuous_usage_stats"}):
        _fail(endpoint, f"'stream_options' must be {{\"include_usage\": true|false}}, got {options!r}")
    if options is not None and not body.get("stream"):
        _fail(endpoint, "'stream_options' can only be given with 'stream': true (as vLLM requires)")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            _fail(endpoint, f"'{key}' must be 0 (penalties would change the trained log-probs), got {body[key]!r}")
    if body.get("logit_bias"):
        _fail(endpoint, "'logit_bias' is not supported (it would change the trained log-probs)")
    return body


def _streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    return bool(body.get("stream")), bool((body.get("stream_options") or {}).get("include_usage"))


def _number(body: dict, key: str, endpoint: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        _fail(endpoint, f"'{key}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, key: str, endpoint: str, minimum: int, maximum: int = INT_MAX) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        _fail(endpoint, f"'{key}' must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def _sampling(body: dict, endpoint: str) -> OpenAISampling:
    max_tokens = _integer(body, "max_completion_tokens", endpoint, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", endpoint, 1)
    top_p = _number(body, "top_p", endpoint, 1.0, 0.0, 1.0)
    if top_p == 0.0:
        _fail(endpoint, "'top_p' must be > 0")
    n = _integer(body, "n", endpoint, 1) or 1
    if n > MAX_N:
        _fail(endpoint, f"'n' must be at most {MAX_N} samples per request, got {n}; send several requests")
    return OpenAISampling(max_tokens=max_tokens, temperature=_number(body, "temperature", endpoint, 1.0, 0.0, 2.0),
                          top_p=top_p, seed=_integer(body, "seed", endpoint, 0, SEED_MAX - MAX_N), n=n,
                          stop=parse_stop(body.get("stop"), endpoint))


def _top_logprobs(body: dict, key: str, endpoint: str) -> Optional[int]:
    value = _integer(body, key, endpoint, 0)
    if value is not None and value > MAX_TOP_LOGPROBS:
        _fail(endpoint, f"'{key}' must be at most {MAX_TOP_LOGPROBS}, got {value}")
    return value


def _tool_choice(choice: Any, tools: Optional[list[dict]], endpoint: str) -> ToolChoice:
    """vLLM's checks: a choice other than "none"/"auto" needs `tools`, a named function must be one of them."""
    if choice is None:
        return ToolChoice()
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            _fail(endpoint, f"'tool_choice' must be \"auto\", \"none\", \"required\" or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        names = [t["function"]["name"] for t in tools or ()]
        if function["name"] not in names:
            _fail(endpoint, f"'tool_choice' names the function {function['name']!r}, which is not in 'tools' "
                            f"({names})")
        return ToolChoice(mode="function", name=function["name"])
    if choice not in ("auto", "none", "required"):
        _fail(endpoint, f"'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, got {choice!r}")
    if choice == "required" and not tools:
        _fail(endpoint, "'tool_choice' \"required\" needs 'tools' (the functions a call may name)")
    return ToolChoice(mode=choice)


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
    tool_choice = _tool_choice(body.get("tool_choice"), tools, endpoint)
    if body.get("logprobs") not in (None, True, False):
        _fail(endpoint, f"'logprobs' must be true or false, got {body['logprobs']!r}")
    top_logprobs = _top_logprobs(body, "top_logprobs", endpoint) or 0
    if top_logprobs and not body.get("logprobs"):
        _fail(endpoint, "'top_logprobs' needs 'logprobs': true (as vLLM and OpenAI require)")
    stream, include_usage = _streaming(body)
    return ChatRequest(messages=body["messages"], tools=tools or None, sampling=_sampling(body, endpoint),
                       logprobs=bool(body.get("logprobs")), top_logprobs=top_logprobs, tool_choice=tool_choice,
                       stream=stream, include_usage=include_usage)


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
    logprobs = _top_logprobs(body, "logprobs", endpoint)
    stream, include_usage = _streaming(body)
    return CompletionRequest(prompt=prompt, sampling=_sampling(body, endpoint), logprobs=logprobs is not None,
                             top_logprobs=logprobs or 0, stream=stream, include_usage=include_usage)


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


@dataclass(frozen=True)
class Choice:
    """One sample of a request, as the answer shows it."""

    output: GenerateOutput
    """The engine's output (cut at the stop string when one matched)."""
    text: str
    """Its text (before the stop string)."""
    parsed: Optional[ParsedToolCalls] = None
    """Chat: the content and tool calls of `text`."""
    stop: Optional[str] = None
    """The stop string that ended it (vLLM's `stop_reason`), None otherwise."""


TokenText = Callable[[int], str]
"""A token id's text as log-probs show it."""


def _finish_reason(output: GenerateOutput, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if output.finish_reason == "length" else "stop"


def _usage(num_prompt: int, choices: list[Choice]) -> dict:
    generated = sum(len(c.output.output_ids) for c in choices)
    return {"prompt_tokens": num_prompt, "completion_tokens": generated, "total_tokens": num_prompt + generated}


def _stacx_fields(output: GenerateOutput) -> dict:
    return {"weight_version": output.weight_version, "output_token_ids": list(output.output_ids)}


def _chat_token(text: str, log_prob: float) -> dict:
    return {"token": text, "logprob": log_prob, "bytes": list(text.encode())}


def chat_logprobs(output: GenerateOutput, token_text: TokenText, top_logprobs: int) -> dict:
    """A chat choice's `logprobs`: one entry per output id, with its `top_logprobs` most likely tokens."""
    tops = output.output_top_log_probs if top_logprobs else [()] * len(output.output_ids)
    return {"content": [{**_chat_token(token_text(token), lp),
                         "top_logprobs": [_chat_token(token_text(t), p) for p, t in top[:top_logprobs]]}
                        for token, lp, top in zip(output.output_ids, output.output_log_probs, tops)]}


def completion_logprobs(output: GenerateOutput, token_text: TokenText, top_logprobs: int, offset: int = 0) -> dict:
    """A completion choice's `logprobs`; `top_logprobs` per position holds the N most likely tokens and
    the sampled one (as vLLM's), None for `logprobs: 0`."""
    texts = [token_text(t) for t in output.output_ids]
    offsets = []
    for piece in texts:
        offsets.append(offset)
        offset += len(piece)
    tops = None
    if top_logprobs:
        tops = [{**{token_text(t): p for p, t in top[:top_logprobs]}, text: lp}
                for top, text, lp in zip(output.output_top_log_probs, texts, output.output_log_probs)]
    return {"tokens": texts, "token_logprobs": list(output.output_log_probs), "top_logprobs": tops,
            "text_offset": offsets}


def chat_message(parsed: ParsedToolCalls) -> dict:
    message: dict = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls else None}
    if parsed.calls:
        message["tool_calls"] = [{"id": call.call_id, "type": "function",
                                  "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                 for call in parsed.calls]
    return message


def render_chat_response(choices: list[Choice], *, num_prompt_tokens: int, model: str,
                         token_text: Optional[TokenText], top_logprobs: int = 0) -> dict:
    """A `chat.completion` object; `token_text` when log-probs were asked for."""
    rendered = []
    for index, choice in enumerate(choices):
        logprobs = None if token_text is None else chat_logprobs(choice.output, token_text, top_logprobs)
        rendered.append({"index": index, "message": chat_message(choice.parsed), "logprobs": logprobs,
                         "finish_reason": _finish_reason(choice.output, bool(choice.parsed.calls)),
                         "stop_reason": choice.stop, "stacx": _stacx_fields(choice.output)})
    first = choices[0].output
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": f"weights-v{first.weight_version}", "choices": rendered,
            "usage": _usage(num_prompt_tokens, choices), "stacx": _stacx_fields(first)}


def render_completion_response(choices: list[Choice], *, num_prompt_tokens: int, model: str,
                               token_text: Optional[TokenText], top_logprobs: int = 0) -> dict:
    """A `text_completion` object; `token_text` when log-probs were asked for."""
    rendered = [{"index": index, "text": choice.text,
                 "logprobs": None if token_text is None else completion_logprobs(choice.output, token_text,
                                                                                 top_logprobs),
                 "finish_reason": _finish_reason(choice.output, False), "stop_reason": choice.stop,
                 "stacx": _stacx_fields(choice.output)}
                for index, choice in enumerate(choices)]
    first = choices[0].output
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": f"weights-v{first.weight_version}", "choices": rendered,
            "usage": _usage(num_prompt_tokens, choices), "stacx": _stacx_fields(first)}
