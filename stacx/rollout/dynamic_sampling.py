"""Dynamic sampling (DAPO): drop prompt groups whose rewards are all equal, refill by over-sampling.

A group whose n responses all got the same reward has zero group-normalized advantage and
contributes no gradient; keeping it only dilutes the batch. The sampler keeps drawing prompts
(`over_sampling_factor` times the missing count per round) until `target_groups` informative
groups are collected or `max_rounds` is reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

Group = TypeVar("Group")


def is_informative(rewards: Sequence[float], tolerance: float = 0.0) -> bool:
    """False when every reward in the group equals the first (within `tolerance`)."""
    return any(abs(r - rewards[0]) > tolerance for r in rewards)


@dataclass
class DynamicSamplingResult:
    groups: list = field(default_factory=list)
    num_drawn: int = 0
    num_dropped: int = 0
    num_rounds: int = 0


def collect_informative_groups(
    generate_groups: Callable[[int], list],
    group_rewards: Callable[[object], Sequence[float]],
    *,
    target_groups: int,
    over_sampling_factor: float = 1.5,
    max_rounds: int = 8,
) -> DynamicSamplingResult:
    """Call `generate_groups(k)` (k new prompt groups) until `target_groups` informative ones exist.

    Raises RuntimeError after `max_rounds` if the batch cannot be filled (every group degenerate).
    """
    if over_sampling_factor < 1.0:
        raise ValueError(f"over_sampling_factor must be >= 1, got {over_sampling_factor}")
    result = DynamicSamplingResult()
    while len(result.groups) < target_groups:
        if result.num_rounds >= max_rounds:
            raise RuntimeError(
                f"dynamic sampling: only {len(result.groups)} of {target_groups} groups had differing rewards after "
                f"{max_rounds} rounds ({result.num_drawn} drawn, {result.num_dropped} dropped); the task may be "
                "too easy or too hard for the current policy"
            )
        missing = target_groups - len(result.groups)
        drawn = generate_groups(max(1, math.ceil(missing * over_sampling_factor)))
        result.num_rounds += 1
        result.num_drawn += len(drawn)
        for group in drawn:
            if is_informative(group_rewards(group)):
                result.groups.append(group)
            else:
                result.num_dropped += 1
    result.groups = result.groups[:target_groups]
    return result
