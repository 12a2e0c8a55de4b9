"""The client of a streamed `/generate` (stacx.serving.generate_stream): each request's tokens are kept as they
arrive, so when the stream breaks (the engine's process died) the `ServerUnavailableError` carries them as
`partial`, one output per request with finish reason "abort" (a call the server refused as the request's fault
raises `ServerRequestError`, as unstreamed), and a supervised pool continues each from its
tokens on a live engine, every token keeping its log-prob fields, routed experts and weight version, the prompt
its log-probs (stacx.rollout.engine_health; the pieces' format: stacx.wire.generate_progress).

    outputs = generate_streamed(transport, requests)
"""

from __future__ import annotations

from typing import Sequence

from stacx.wire.generate_progress import extend_output
from stacx.wire.http_client import HttpTransport, ServerRequestError, ServerUnavailableError
from stacx.wire.sglang_protocol import build_generate_payload, parse_generate_response
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
