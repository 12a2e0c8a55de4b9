"""A streamed `/generate` (`"stream": true`): the tokens of each request as they are generated, then the answer,
so a client keeps what an engine generated before its process died (stacx.rollout.salvage's pool path continues
them on a live engine).

The answer is `application/x-ndjson`, one JSON object a line:

    {"progress": [<piece>, ...]}    each request's new tokens with all their fields (every STREAM_INTERVAL_S
                                    while any changed; the pieces' format: stacx.wire.generate_progress)
    ...
    {"result": <exactly the answer the same call gets unstreamed>}
    {"error": "...", "status": 500}  instead of the result: the call failed after the answer began (the status
                                    the unstreamed call answers: 4xx is the request's fault, 5xx the engine's)

A piece carries everything the answer carries for its tokens (log-probs, top-k and token-id log-probs, routed
experts; the prompt's log-probs once, with the first tokens), read from what an engine that decodes in this process
records on the request's `AbortFlag` (`output`, `routes`) as it decodes. Another engine streams no pieces: its
answer comes as the result line only.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Sequence

from stacx.serving.http_guard import HttpError
from stacx.wire.generate_progress import ready_tokens, render_piece
from stacx.wire.weight_versions import StaleWeightsError
from stacx.wire.sglang_protocol import render_generate_item

STREAM_INTERVAL_S = 0.05
"""How often the stream looks for new tokens (a line is sent only when some request has new ones)."""


def stream_asked(payload: Any) -> bool:
    """Whether a `/generate` body asks a streamed answer; removes its `stream` field (the rest is parsed as usual)."""
    if not isinstance(payload, dict) or "stream" not in payload:
        return False
    stream = payload.pop("stream")
    if not isinstance(stream, bool):
        raise ValueError(f"/generate: 'stream' must be true or false, got {stream!r}")
    return stream


def progress(flags: Sequence[Any], requests: Sequence[Any], sent: list[int]) -> list[dict]:
    """Each request's tokens since `sent[i]` (advanced here) that have every field it asks."""
    lines = []
    for index, (flag, request) in enumerate(zip(flags, requests)):
        output = flag.output
        if output is None:
            continue
        ready = ready_tokens(output, request, flag.routes)
        if ready <= sent[index]:
            continue
        lines.append(render_piece(index, output, request, sent[index], ready, flag.routes))
        sent[index] = ready
    return lines


async def stream_generate(server: Any, request: Any, requests: list, is_batch: bool) -> AsyncIterator[bytes]:
    """The lines of a streamed `/generate` of `requests` on `server` (an EngineHttpServer; module doc)."""
    flags = server.aborts.register([r.rid for r in requests])
    call = asyncio.ensure_future(server.run_engine(request, requests, flags=flags))
    sent = [0] * len(requests)
    try:
        while not call.done():
            await asyncio.wait({call}, timeout=STREAM_INTERVAL_S)
            new = progress(flags, requests, sent)
            if new:
                yield _line({"progress": new})
        outputs = call.result()
    except asyncio.CancelledError:
        call.cancel()
        raise
    except Exception as err:  # noqa: BLE001 - the status line is sent already: the error is the last line
        yield _line(error_line(err))
        return
    items = [render_generate_item(o, r, r.rid or uuid.uuid4().hex, server.tokenizer) for o, r in zip(outputs, requests)]
    yield _line({"result": items if is_batch else items[0]})


def error_line(err: Exception) -> dict:
    """The last line of a call that failed after its answer began, with the status the unstreamed call answers
    (4xx: the request's fault, which the client raises as a rejection, not as a failed engine)."""
    if isinstance(err, HttpError):
        return {"error": str(err), "status": err.status}
    if isinstance(err, StaleWeightsError):
        return {"error": str(err), "status": 409, **err.fields}
    if isinstance(err, ValueError):  # the caller's mistake
        return {"error": str(err), "status": 400}
    return {"error": f"{type(err).__name__}: {err}", "status": 500}


def _line(body: dict) -> bytes:
    return (json.dumps(body) + "\n").encode()
