"""Asynchronous runs replace a group with a dropped member by a fresh prompt, as synchronous ones do.

A group whose episode still fails for an infrastructure reason after `--episode-retries`, or whose reward call
failed every time (`stacx.rollout.episode_retry.is_dropped`), is not handed to the trainer: the producer draws
the next prompt of the data order and plays it under the same group id (`AsyncRollout._fresh_prompt`), so the
scheduler's batch keeps its size, the group keeps its admission version (the staleness bound holds), and GRPO's
group statistics are over complete groups only. The dropped prompt counts as consumed (a resumed run does not
draw it again).

    replacements = GroupReplacements(max_dropped_fraction=0.25)
    reasons = replacements.played(samples)          # the group's drop reasons ([] when complete), counted
    replacements.replaced(reasons)                  # the group is played again with a fresh prompt
    metrics = replacements.take_metrics(step)       # per batch: rollout/groups_replaced, rollout/episodes_dropped

A batch window (from one `take_metrics` to the next) whose dropped episodes pass `max_dropped_fraction` of those
played stops the run (`EpisodeLossError`, naming the commonest causes); a group replaced `MAX_REPLACEMENT_ROUNDS`
times in a row does too.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Sequence

from stacx.rollout.episode_retry import MAX_REPLACEMENT_ROUNDS, check_dropped_fraction, is_dropped

__all__ = ["GroupReplacements", "MAX_REPLACEMENT_ROUNDS"]


class GroupReplacements:
    """The dropped episodes and replaced groups of an asynchronous run (module doc); thread-safe."""

    def __init__(self, *, max_dropped_fraction: float):
        self.max_dropped_fraction = max_dropped_fraction
        self._lock = threading.Lock()
        self._played = 0
        self._reasons: Counter = Counter()
        self._replaced = 0
        self.total_replaced = 0
        """Groups replaced over the run."""

    def played(self, samples: Sequence[Any], failures: Sequence[str] = ()) -> list[str]:
        """Count a finished group's episodes (`samples`, or `failures`: the reasons of its episodes still failing
        after their retries, for a multi-turn group) and return why members were dropped ([] when none was)."""
        reasons = list(failures) or [reason for reason in map(is_dropped, samples) if reason]
        with self._lock:
            self._played += max(len(samples), len(failures))
            self._reasons.update(reason if len(reason) <= 200 else reason[:200] + "..." for reason in reasons)
        return reasons

    def replaced(self) -> None:
        with self._lock:
            self._replaced += 1
            self.total_replaced += 1

    def take_metrics(self, step: int) -> dict[str, float]:
        """rollout/groups_replaced and rollout/episodes_dropped since the last batch; `EpisodeLossError` when the
        dropped episodes pass --max-dropped-fraction of those played meanwhile."""
        with self._lock:
            played, reasons, replaced = self._played, self._reasons, self._replaced
            self._played, self._reasons, self._replaced = 0, Counter(), 0
        dropped = sum(reasons.values())
        check_dropped_fraction(dropped, played, self.max_dropped_fraction, reasons, step=step)
        return {"rollout/groups_replaced": float(replaced), "rollout/episodes_dropped": float(dropped)}
