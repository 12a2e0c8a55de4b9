"""`stop` strings of the OpenAI-compatible endpoint: where a generation ends, in text and in ids.

The engine stops at token ids only, so a stop string is applied to its finished output: the answer's
text ends before the first occurrence of any stop string (the string itself excluded, as vLLM and
OpenAI do), and the output is cut after the fewest ids whose text contains it. Those ids — the
ones that produced the stop text included — are what the session records and the trainer trains
on, masked as generated: they are exactly what the engine sampled, in order, so their log-probs
are the engine's and the next turn's prompt continues them token for token. The ids the engine
generated past the stop are dropped (sampling is causal: cutting afterwards gives the same ids as
stopping there, at the cost of the extra decoding steps).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from stacx.rollout.types import GenerateOutput

__all__ = ["MAX_STOP_STRINGS", "StopCut", "cut_at_stop", "parse_stop"]

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop` strings."""


@dataclasses.dataclass(frozen=True)
class StopCut:
    output: GenerateOutput
    """The output up to and including the id that completed the stop string (finish_reason "stop")."""
    text: str
    """Its text before the stop string."""
    stop: str
    """The stop string matched (vLLM's `stop_reason`)."""


def parse_stop(value, endpoint: str) -> tuple[str, ...]:
    """`stop`: null, a string or a list of up to 4 non-empty strings -> a tuple of strings."""
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"{endpoint}: 'stop' must be a non-empty string or a list of non-empty strings, "
                         f"got {value!r}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"{endpoint}: 'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    return tuple(strings)


def _first_stop(text: str, stops: Sequence[str]) -> Optional[tuple[int, str]]:
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found) if found else None


def cut_at_stop(output: GenerateOutput, decode: Callable[[list[int]], str], stops: Sequence[str]) -> Optional[StopCut]:
    """The output cut at its first stop string, or None when its text holds none. `decode` turns ids
    into the answer's text (the same decoding as the answer)."""
    ids = list(output.output_ids)
    if not stops or _first_stop(decode(ids), stops) is None:
        return None
    low, high = 1, len(ids)  # the fewest ids whose text holds a stop string: a prefix's text only grows
    while low < high:
        middle = (low + high) // 2
        if _first_stop(decode(ids[:middle]), stops) is None:
            low = middle + 1
        else:
            high = middle
    text = decode(ids[:low])
    at, stop = _first_stop(text, stops)
    cut = dataclasses.replace(
        output, output_ids=ids[:low], output_log_probs=list(output.output_log_probs[:low]),
        output_top_log_probs=list(output.output_top_log_probs[:low]),
        output_token_ids_log_probs=list(output.output_token_ids_log_probs[:low]),
        output_token_versions=list(output.output_token_versions[:low]), finish_reason="stop")
    return StopCut(output=cut, text=text[:at], stop=stop)
