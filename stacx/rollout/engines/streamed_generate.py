"""The client of a streamed `/generate` (stacx.serving.generate_stream): each request's tokens are kept as they
arrive, so when the stream breaks (the engine's process died) the `ServerUnavailableError` carries them as
`partial`, one output per request with finish reason "abort" (a call the server refused as the request's fault
raises `ServerRequestError`, as unstreamed), and a supervised pool continues each from its
tokens on a live engine, every token keeping its log-prob fields, routed experts and weight version, the prompt
its log-probs (stacx.rollout.engine_health; the pieces' format: stacx.wire.generate_progress).

SGLang streams its own format (server-sent events, one request's state each: stacx.wire.sglang_stream);
`generate_sglang_streamed` reads it with the same contract: the tokens received are `partial` when the stream
breaks (or SGLang aborts a request with a 5xx status), a request SGLang refuses is `ServerRequestError`.

    outputs = generate_streamed(transport, requests)
    outputs = generate_sglang_streamed(transport, requests, build_generate_payload(requests))
"""

from __future__ import annotations

from typing import Sequence

from stacx.wire.generate_progress import extend_output
from stacx.wire.http_client import HttpTransport, ServerRequestError, ServerUnavailableError
from stacx.wire.sglang_protocol import build_generate_payload, parse_generate_response
from stacx.wire.sglang_stream import SglangStream
from stacx.wire.sglang_stream import stream_error as sglang_stream_error
from stacx.wire.types import GenerateOutput, GenerateRequest


def generate_streamed(transport: HttpTransport, requests: Sequence[GenerateRequest], *,
                      summary: str = "") -> list[GenerateOutput]:
    """The outputs of `requests` from a streamed `/generate`; a broken stream raises `ServerUnavailableError`
    with `partial` (module doc)."""
    payload = {**build_generate_payload(requests), "stream": True}
    partial = [GenerateOutput(output_ids=[], finish_reason="abort") for _ in requests]
    try:
        for line in transport.post_lines("/generate", payload, summary=summary):
            if "result" in line:
                return parse_generate_response(line["result"], requests)
            if "error" in line and 400 <= int(line.get("status", 500)) < 500:  # the request's fault, as unstreamed
                raise ServerRequestError(f"server {transport.url} rejected /generate (request: {summary or '-'}): "
                                         f"HTTP {line['status']}: {line['error']}", int(line["status"]), line)
            if "error" in line:
                raise ServerUnavailableError(transport.url, "/generate", summary or "-", 1,
                                             f"the engine failed during the call: {line['error']}")
            for piece in line.get("progress", ()):
                index = int(piece["index"])
                extend_output(partial[index], requests[index], piece)
        raise ServerUnavailableError(transport.url, "/generate", summary or "-", 1, "the answer ended without a result")
    except ServerUnavailableError as err:
        err.partial = partial
        raise


def sglang_streams(request: GenerateRequest) -> bool:
    """Whether `request` is worth streaming from SGLang and its events carry everything it asks for: it generates
    tokens (a scoring call, max_new_tokens 0, has none to keep), and asks no routed experts (the events hold every
    log-prob field, cumulative, but not the routes: those requests go unstreamed)."""
    return request.sampling.max_new_tokens > 0 and not request.return_routed_experts


def generate_sglang_streamed(transport: HttpTransport, requests: Sequence[GenerateRequest], payload: dict, *,
                             summary: str = "") -> list[GenerateOutput]:
    """The outputs of `requests` (whose batched `/generate` body is `payload`) from SGLang's streamed answer
    (stacx.wire.sglang_stream): a request SGLang refuses raises `ServerRequestError` (4xx, as unstreamed); an
    engine that fails or dies during the call raises `ServerUnavailableError` with `partial`, the tokens
    received (module doc)."""
    stream = SglangStream(requests)
    try:
        for event in transport.post_events("/generate", {**payload, "stream": True}, summary=summary):
            error = sglang_stream_error(event)
            if error is not None and 400 <= error[0] < 500:  # the request's fault, as unstreamed
                raise ServerRequestError(f"server {transport.url} rejected /generate (request: {summary or '-'}): "
                                         f"HTTP {error[0]}: {error[1]}", error[0], event)
            if error is not None:
                raise ServerUnavailableError(transport.url, "/generate", summary or "-", 1,
                                             f"the engine failed during the call: HTTP {error[0]}: {error[1]}")
            stream.add(event)
        if not stream.done():
            unfinished = [i for i, finished in enumerate(stream.finished) if not finished]
            raise ServerUnavailableError(transport.url, "/generate", summary or "-", 1,
                                         f"the answer ended before requests {unfinished} finished")
    except ServerUnavailableError as err:
        err.partial = stream.partial()
        raise
    return stream.outputs()
