"""`stop` strings of the OpenAI-compatible endpoint: where a generation ends, in text and in ids.

The engine stops at token ids only, so a stop string is applied to its finished output: the answer's
text ends before the first occurrence of any stop string (the string itself excluded, as vLLM and
OpenAI do), and the output is cut after the fewest ids whose text contains it. Those ids — the
ones that produced the stop text included — are what the session records and the trainer trains
on, masked as generated: they are exactly what the engine sampled, in order, so their log-probs
are the engine's and the next turn's prompt continues them token for token. The ids the engine
generated past the stop are dropped (sampling is causal: cutting afterwards gives the same ids as
stopping there, at the cost of the extra decoding steps). The cut itself is
`stacx.serving.stop_sequences.cut_at_stop_sequences`, shared with Anthropic's `stop_sequences`;
this module parses OpenAI's `stop` field.
"""

from __future__ import annotations

__all__ = ["MAX_STOP_STRINGS", "parse_stop"]

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop` strings."""


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
