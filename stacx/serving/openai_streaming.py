"""`stream: true` on the OpenAI-compatible endpoint: an answer as server-sent events, vLLM's chunks.

    data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    data: {... "delta": {"content": "ls"}, "logprobs": {"content": [one token]}}             one chunk per token
    data: {... "delta": {"tool_calls": [{"index": 0, "id", "type": "function", "function": {"name", "arguments": ""}}]}}
    data: {... "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"command\": \"ls\"}"}}]}}
    data: {... "delta": {}, "finish_reason": "tool_calls", "stop_reason": null, "stacx": {output_token_ids, ...}}
    data: {... "choices": [], "usage": {...}}                               with stream_options.include_usage
    data: [DONE]

The chunks are cut from the answer a non-streamed call gets (the same generation, the same
recorded turn), so the streamed text, calls and log-probs join into exactly that answer. Stacx's
CPU engine hands over a sample when it is finished, so the events follow the end of generation
rather than each decoding step: a client reads the stream as it reads vLLM's, without the
time-to-first-token gain. Content streams one chunk per generated token (each with that token's
log-probs); a reply with tool calls streams its content, then each call as vLLM does (the id and
name, then the arguments).
"""

from __future__ import annotations

import json
from typing import Callable, Iterator, Optional

__all__ = ["chat_chunks", "completion_chunks", "event_stream", "token_pieces"]


def token_pieces(decode: Callable[[list[int]], str], ids: list[int]) -> Optional[list[str]]:
    """The text each id adds to the decoding of the ids before it; None when a prefix's text is not
    a prefix of the next one's (a byte split inside a character)."""
    pieces, before = [], ""
    for end in range(1, len(ids) + 1):
        text = decode(ids[:end])
        if not text.startswith(before):
            return None
        pieces.append(text[len(before):])
        before = text
    return pieces


def _cut_to(pieces: list[str], text: str) -> Optional[list[str]]:
    """`pieces` cut so that they join into `text` (the pieces past it become ""); None when they do not
    start with it."""
    if not "".join(pieces).startswith(text):
        return None
    cut, left = [], len(text)
    for piece in pieces:
        cut.append(piece[:left])
        left -= len(cut[-1])
    return cut


def _chunk(answer: dict, obj: str, choice: dict) -> dict:
    return {"id": answer["id"], "object": obj, "created": answer["created"], "model": answer["model"],
            "system_fingerprint": answer["system_fingerprint"], "choices": [choice]}


def _usage_chunk(answer: dict, obj: str) -> dict:
    return {**_chunk(answer, obj, {}), "choices": [], "usage": answer["usage"]}


def chat_chunks(answer: dict, pieces: list[Optional[list[str]]], include_usage: bool) -> Iterator[dict]:
    """A `chat.completion` answer as `chat.completion.chunk`s; `pieces[i]`: choice i's text per output id
    (None: its content goes in one chunk)."""
    obj = "chat.completion.chunk"
    for choice, token_texts in zip(answer["choices"], pieces):
        index, message, logprobs = choice["index"], choice["message"], choice["logprobs"]
        yield _chunk(answer, obj, {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
        content = message.get("content") or ""
        per_token = None if message.get("tool_calls") or token_texts is None else _cut_to(token_texts, content)
        if per_token is not None:
            entries = logprobs["content"] if logprobs else [None] * len(per_token)
            for piece, entry in zip(per_token, entries):
                yield _chunk(answer, obj, {"index": index, "delta": {"content": piece},
                                           "logprobs": None if entry is None else {"content": [entry]},
                                           "finish_reason": None})
        elif content or logprobs:
            yield _chunk(answer, obj, {"index": index, "delta": {"content": content}, "logprobs": logprobs,
                                       "finish_reason": None})
        for position, call in enumerate(message.get("tool_calls") or ()):
            opening = {"index": position, "id": call["id"], "type": "function",
                       "function": {"name": call["function"]["name"], "arguments": ""}}
            yield _chunk(answer, obj, {"index": index, "delta": {"tool_calls": [opening]}, "logprobs": None,
                                       "finish_reason": None})
            arguments = {"index": position, "function": {"arguments": call["function"]["arguments"]}}
            yield _chunk(answer, obj, {"index": index, "delta": {"tool_calls": [arguments]}, "logprobs": None,
                                       "finish_reason": None})
        yield _chunk(answer, obj, {"index": index, "delta": {}, "logprobs": None,
                                   **{k: choice[k] for k in ("finish_reason", "stop_reason", "stacx")
                                      if k in choice}})
    if include_usage:
        yield _usage_chunk(answer, obj)


def completion_chunks(answer: dict, pieces: list[Optional[list[str]]], include_usage: bool) -> Iterator[dict]:
    """A `text_completion` answer as streamed `text_completion` chunks (vLLM's object name for both)."""
    obj = "text_completion"
    for choice, token_texts in zip(answer["choices"], pieces):
        index, logprobs = choice["index"], choice["logprobs"]
        per_token = None if token_texts is None else _cut_to(token_texts, choice["text"])
        if per_token is not None:
            for position, piece in enumerate(per_token):
                one = None if logprobs is None else {
                    key: None if logprobs[key] is None else logprobs[key][position:position + 1]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
                yield _chunk(answer, obj, {"index": index, "text": piece, "logprobs": one, "finish_reason": None})
        else:
            yield _chunk(answer, obj, {"index": index, "text": choice["text"], "logprobs": logprobs,
                                       "finish_reason": None})
        yield _chunk(answer, obj, {"index": index, "text": "", "logprobs": None,
                                   **{k: choice[k] for k in ("finish_reason", "stop_reason", "stacx") if k in choice}})
    if include_usage:
        yield _usage_chunk(answer, obj)


def event_stream(chunks: Iterator[dict]) -> Iterator[bytes]:
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`."""
    for chunk in chunks:
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
