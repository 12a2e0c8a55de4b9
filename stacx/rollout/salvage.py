"""The tokens a failing engine generated, kept: its requests continue from them on a live engine.

When the supervisor notices that an engine stopped making progress on a call (it missed its health checks, or
the call ran past `--engine-deadline-s`, stacx.rollout.engine_health), and every request of the call carries a
rid (partial rollout's requests do), it first asks that engine to abort them. An engine that still answers
returns what it generated so far (finish reason "abort"), and the pool continues each such request on a live
engine from those tokens (`continuation_request`, joined by `join_outputs`: every token keeps the behaviour
log-prob and weight version of the engine that sampled it); a request that had finished keeps its output.

    kept = salvaged(requests, outputs)           # {position: the aborted output} of what continues
    rest = pool.generate([continuation_request(requests[i], out) for i, out in kept.items()])
    outputs = joined(requests, outputs, kept, rest)

An engine whose process died answers nothing. `stacx serve` streams its `/generate` answers
(stacx.serving.generate_stream), and vLLM its completions (stacx.rollout.engines.vllm), so their clients hold the
tokens received before the death and raise them as the error's `partial`: they continue the same way. Other engines'
tokens (SGLang's) are lost and their requests start again (a request that was already a continuation carries its
earlier tokens in its prompt, so only the last segment is lost).
`rollout/tokens_salvaged` counts the tokens kept.
"""

from __future__ import annotations

from typing import Optional, Sequence

from stacx.rollout.continuation import join_outputs
from stacx.wire.types import GenerateOutput, GenerateRequest


def can_salvage(requests: Sequence[GenerateRequest]) -> bool:
    """Whether a failing engine can be asked to abort exactly these requests (each has its own rid)."""
    return bool(requests) and all(request.rid for request in requests)


def salvaged(requests: Sequence[GenerateRequest], outputs: Sequence[GenerateOutput]) -> dict[int, GenerateOutput]:
    """{position: aborted output} of the requests that stopped with budget left (they continue on a live engine)."""
    return {index: output for index, (request, output) in enumerate(zip(requests, outputs))
            if output.finish_reason == "abort" and len(output.output_ids) < request.sampling.max_new_tokens}


def joined(outputs: Sequence[GenerateOutput], kept: dict[int, GenerateOutput],
           continued: Sequence[GenerateOutput]) -> list[GenerateOutput]:
    """The call's outputs: the finished ones as they came, each kept one joined with its continuation."""
    rest: dict[int, GenerateOutput] = dict(zip(kept, continued))
    out: list[Optional[GenerateOutput]] = []
    for index, output in enumerate(outputs):
        out.append(join_outputs(kept[index], rest[index]) if index in rest else output)
    return out  # type: ignore[return-value]
