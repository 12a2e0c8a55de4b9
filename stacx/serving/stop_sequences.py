"""Stop strings applied to a finished generation, keeping the recorded ids exactly the sampled ones.

    cut = cut_at_stop_sequences(output, ["\\nObservation:"], decode)
    cut.output          # the generation up to and including the token that completed the stop string
    cut.text            # the reply's text before the stop string
    cut.stop_sequence   # the string that stopped it, or None

The engine stops on token ids only, so a stop string is applied after generation: the output is
cut after the first token whose text completes a stop string. Sampling is causal, so the ids and
log-probs kept are exactly those an engine stopping there would have returned (the tokens after the
cut only cost time); the trainer sees the ids the client's text came from, the stop string's
tokens included (as SGLang and vLLM record them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from stacx.wire.types import GenerateOutput

__all__ = ["StopCut", "cut_at_stop_sequences"]


@dataclass(frozen=True)
class StopCut:
    output: GenerateOutput
    """The generation through the token that completed the stop string (the whole one when none did)."""
    text: str
    """The reply's text, up to (not including) the stop string."""
    stop_sequence: Optional[str]
    """The stop string that ended the reply; None when none occurs."""


def cut_at_stop_sequences(output: GenerateOutput, stops: Sequence[str],
                          decode: Callable[[list[int]], str]) -> StopCut:
    """Cut `output` at the stop string that completes first (see the module doc); `decode` turns
    output ids into the reply's text."""
    ids = list(output.output_ids)
    text = decode(ids)
    found = [(text.find(stop) + len(stop), stop) for stop in stops if stop and stop in text]
    if not found:
        return StopCut(output, text, None)
    _, stop = min(found)
    kept = _first_prefix_containing(ids, stop, decode)
    prefix = decode(ids[:kept])
    return StopCut(_truncated(output, kept), prefix[:prefix.find(stop)], stop)


def _first_prefix_containing(ids: list[int], stop: str, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading ids whose text holds `stop` (binary search: a longer prefix's text extends a
    shorter one's; checked, with a linear scan if a tokenizer's partial characters break that)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if stop in decode(ids[:middle]):
            high = middle
        else:
            low = middle + 1
    if stop in decode(ids[:low]) and (low == 1 or stop not in decode(ids[:low - 1])):
        return low
    return next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))


def _truncated(output: GenerateOutput, kept: int) -> GenerateOutput:
    """`output` with its first `kept` tokens and their per-token fields; finish_reason "stop"."""
    dropped = len(output.output_ids) - kept
    if dropped == 0:
        return dataclasses.replace(output, finish_reason="stop")
    per_token = {name: list(getattr(output, name))[:kept]
                 for name in ("output_log_probs", "output_top_log_probs", "output_token_ids_log_probs",
                              "output_token_versions")
                 if len(getattr(output, name)) == len(output.output_ids)}
    versions = per_token.get("output_token_versions")
    routes = output.routed_experts
    return dataclasses.replace(
        output, output_ids=list(output.output_ids)[:kept], finish_reason="stop", **per_token,
        weight_version=min(versions) if versions else output.weight_version,
        routed_experts=None if routes is None else routes[:routes.shape[0] - dropped])
