"""Request bodies of `stacx serve`, read with bounded memory and time.

The Content-Length is checked against the endpoint's limit before a byte is read or allocated
(413 when larger); chunked bodies are refused (411). A JSON body is read within `read_timeout_s`
in the chunks the connection delivers; a weight body is read into one buffer of exactly its
Content-Length, each chunk copied straight into place, each within `read_timeout_s`.
"""

from __future__ import annotations

import json
import re

import anyio
from starlette.requests import ClientDisconnect, Request

from stacx.serving.http_guard import HttpError


def content_length(request: Request, limit: int) -> int:
    """The request's Content-Length, refused (with the connection closed) when missing on a chunked
    body, malformed, or larger than `limit` bytes."""
    if request.headers.get("transfer-encoding"):
        raise HttpError(411, "chunked request bodies are not supported; send Content-Length", close=True)
    raw = request.headers.get("content-length")
    if raw is None:
        return 0
    try:
        length = int(raw)
    except ValueError:
        raise HttpError(400, f"Content-Length {raw[:40]!r} is not an integer", close=True) from None
    if length < 0:
        raise HttpError(400, f"Content-Length {length} is negative", close=True)
    if length > limit:
        raise HttpError(413, f"request body of {length} bytes exceeds the server's limit of {limit} bytes",
                        close=True)
    return length


async def _chunks(request: Request, length: int, *, timeout_s: float, whole_deadline: bool):
    """The body's chunks as they arrive, `length` bytes in all; each chunk within `timeout_s`
    (`whole_deadline`: the whole body within it)."""
    stream = request.stream().__aiter__()
    deadline = anyio.current_time() + timeout_s
    read = 0
    while read < length:
        wait_s = deadline - anyio.current_time() if whole_deadline else timeout_s
        chunk = None
        with anyio.move_on_after(max(wait_s, 0.0)):
            try:
                chunk = await stream.__anext__()
            except (StopAsyncIteration, ClientDisconnect):
                chunk = b""
        if chunk is None:
            raise HttpError(408, f"request body stalled for {timeout_s:.0f}s after {read} of {length} bytes",
                            close=True)
        if not chunk:
            raise HttpError(400, f"request body ended after {read} of {length} bytes", close=True)
        if read + len(chunk) > length:
            raise HttpError(400, f"request body is longer than its Content-Length {length}", close=True)
        read += len(chunk)
        yield chunk


async def read_body_into(request: Request, buffer: bytearray, *, timeout_s: float) -> None:
    """Fill `buffer` (sized from the checked Content-Length) with the body, each chunk copied into
    place as it arrives and each within `timeout_s`."""
    view, read = memoryview(buffer), 0
    async for chunk in _chunks(request, len(buffer), timeout_s=timeout_s, whole_deadline=False):
        view[read:read + len(chunk)] = chunk
        read += len(chunk)


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a JSON body may have (an OpenAI chat request needs about 8); a
1,000-deep body made Python's JSON reader raise RecursionError, a 500 that clients retry."""
PARSE_IN_THREAD_BYTES = 64 * 1024
"""A body larger than this is parsed and checked off the event loop, so other requests (`/health`) never wait."""


async def read_json(request: Request, *, limit: int, timeout_s: float):
    """The JSON body ({} when empty), all of it within `timeout_s`; memory follows the bytes that
    really arrived (never the claimed length). NaN and Infinity, nesting deeper than MAX_JSON_DEPTH and
    strings that are not Unicode text (a lone surrogate such as "\\ud800") are refused, naming where."""
    length = content_length(request, limit)
    raw = b"".join([chunk async for chunk in _chunks(request, length, timeout_s=timeout_s, whole_deadline=True)])
    if not raw:
        return {}
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await anyio.to_thread.run_sync(parse_json_body, raw)
    return parse_json_body(raw)


def parse_json_body(raw: bytes):
    """`raw` parsed, then checked by `check_json_value` (ValueError names what is wrong and where)."""
    try:
        value = json.loads(raw, parse_constant=_reject_json_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"request body is not JSON: {err}") from err
    except RecursionError:
        raise ValueError(f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels") from None
    check_json_value(value)
    return value


def check_json_value(value, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a parsed body without recursion: ValueError naming the path (`messages[0].content`) of the first
    container nested deeper than `max_depth`, or of a string holding a lone surrogate."""
    stack = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            bad = _SURROGATE.search(item)
            if bad:
                raise ValueError(f"request body: '{path or '(body)'}' holds a lone surrogate {bad.group()!r} at "
                                 f"character {bad.start()}, which is not text; send valid Unicode")
            continue
        if isinstance(item, dict):
            children = [(child, f"{path}.{key}" if path else str(key)) for key, child in item.items()]
            children += [(key, f"{path}.<key>" if path else "<key>") for key in item]
        elif isinstance(item, list):
            children = [(child, f"{path}[{i}]") for i, child in enumerate(item)]
        else:
            continue
        if depth > max_depth:
            field = re.split(r"[.\[]", path, maxsplit=1)[0] or "(body)"
            raise ValueError(f"request body: '{field}' nests arrays or objects deeper than {max_depth} levels; "
                             "send a flatter body")
        stack.extend((child, where, depth + 1) for child, where in children)


_SURROGATE = re.compile("[\ud800-\udfff]")


def count_text_chars(value) -> int:
    """Characters in every string of a parsed body (keys included), without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def check_text_budget(value, max_chars: int, where: str) -> None:
    """ValueError (400) when the text in `value` (a prompt, a chat's messages and tools) is longer than `max_chars`:
    checked before tokenizing, which for a 10 MB prompt took seconds and gigabytes only to refuse it."""
    chars = count_text_chars(value)
    if chars > max_chars:
        raise ValueError(f"{where} holds {chars:,} characters of text, more than the {max_chars:,} this server "
                         "tokenizes (ServerLimits.max_chars_per_token x the model's context length: "
                         "--max-chars-per-token); a prompt that long cannot fit the context")


def _reject_json_constant(name: str):
    raise ValueError(f"request body holds {name}, which is not valid JSON; send finite numbers")
