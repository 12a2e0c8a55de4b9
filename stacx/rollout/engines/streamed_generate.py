"""The client of a streamed `/generate` (stacx.serving.generate_stream): each request's tokens are kept as they
arrive, so when the stream breaks (the engine's process died) the `ServerUnavailableError` carries them as
`partial`, one output per request with finish reason "abort", and a supervised pool continues each from its
tokens on a live engine, every token keeping its log-prob and weight version (stacx.rollout.engine_health).

    if streamable(requests):
        outputs = generate_streamed(transport, requests)
"""

from __future__ import annotations

from typing import Sequence

from stacx.wire.http_client import HttpTransport, ServerUnavailableError
from stacx.wire.sglang_protocol import build_generate_payload, parse_generate_response
from stacx.wire.types import GenerateOutput, GenerateRequest


def streamable(requests: Sequence[GenerateRequest]) -> bool:
    """Whether a stream carries everything a partial output of these requests needs: no top-k or token-id
    log-probs, no prompt log-probs, no routed experts (those come with the final answer only)."""
    return bool(requests) and all(not r.top_logprobs_num and not r.token_ids_logprob and r.logprob_start_len < 0
                                  and not r.return_routed_experts for r in requests)


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
            if "error" in line:
                raise ServerUnavailableError(transport.url, "/generate", summary or "-", 1,
                                             f"the engine failed during the call: {line['error']}")
            for piece in line.get("progress", ()):
                _extend(partial[int(piece["index"])], piece)
        raise ServerUnavailableError(transport.url, "/generate", summary or "-", 1, "the answer ended without a result")
    except ServerUnavailableError as err:
        err.partial = partial
        raise


def _extend(output: GenerateOutput, piece: dict) -> None:
    """Append a progress line's tokens to `output` (they continue it exactly: `start` is its length)."""
    if int(piece["start"]) != len(output.output_ids):
        raise ValueError(f"/generate stream: tokens from {piece['start']} after {len(output.output_ids)} received")
    ids, version = [int(t) for t in piece["output_ids"]], int(piece["weight_version"])
    output.output_ids.extend(ids)
    output.output_log_probs.extend(float(lp) for lp in piece.get("output_log_probs", ()))
    output.output_token_versions.extend([version] * len(ids))
    output.weight_version = version if len(output.output_ids) == len(ids) else min(output.weight_version, version)
