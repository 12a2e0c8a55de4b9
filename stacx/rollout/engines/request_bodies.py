"""Request bodies of `stacx serve`, read with bounded memory and time.

The Content-Length is checked against the endpoint's limit before a byte is read or allocated
(413 when larger); chunked bodies are refused (411). A JSON body is read within `read_timeout_s`
in the chunks the connection delivers; a weight body is read into one buffer of exactly its
Content-Length, each chunk copied straight into place, each within `read_timeout_s`.
"""

from __future__ import annotations

import json

import anyio
from starlette.requests import ClientDisconnect, Request

from stacx.rollout.engines.http_guard import HttpError


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


async def read_json(request: Request, *, limit: int, timeout_s: float):
    """The JSON body ({} when empty), all of it within `timeout_s`; memory follows the bytes that
    really arrived (never the claimed length). NaN and Infinity are refused."""
    length = content_length(request, limit)
    raw = b"".join([chunk async for chunk in _chunks(request, length, timeout_s=timeout_s, whole_deadline=True)])
    if not raw:
        return {}
    try:
        return json.loads(raw, parse_constant=_reject_json_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"request body is not JSON: {err}") from err


def _reject_json_constant(name: str):
    raise ValueError(f"request body holds {name}, which is not valid JSON; send finite numbers")
