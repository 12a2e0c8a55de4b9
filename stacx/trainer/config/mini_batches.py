"""Mini-batch updates per rollout: how many optimizer steps one rollout feeds, and which samples each takes.

A rollout step collects R = rollout_batch_size x n_samples_per_prompt samples (rollout recipes;
dataset recipes read rollout_batch_size rows, a DPO row being one chosen/rejected pair) and trains
on them in

    num_epochs passes x num_steps_per_rollout mini-batches of global_batch_size samples

with R = global_batch_size x num_steps_per_rollout. Either flag derives the other; neither means one
optimizer step per rollout (the whole rollout); inconsistent values are refused before the run
starts (`resolve_mini_batch_schedule`, called by the preflight and the loop).

The split (`mini_batch_indices`): every pass shuffles the rollout's prompt groups (samples with one
`prompt_id`; DPO pairs; else single samples) with a generator seeded by (seed, rollout step, pass),
lays them end to end and cuts the sequence into num_steps_per_rollout consecutive slices of equal
size (sizes differ by at most one when R is not a multiple). When global_batch_size is a multiple of
n_samples_per_prompt every cut falls between groups, so each prompt group stays in one mini-batch;
otherwise a group may straddle two (valid: advantages were computed over the whole rollout first).
A DPO pair never straddles: its cut moves to the pair's end. The schedule depends only on the batch
and the seeds, so every rank (torchrun) computes the same one.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Sequence

from stacx.trainer.config.run import ConfigError, RunConfig


@dataclass(frozen=True, kw_only=True)
class MiniBatchSchedule:
    """The resolved mini-batch settings of a run."""

    global_batch_size: int
    """Samples per optimizer step (nominal: a rollout with another sample count is cut the same way)."""
    num_steps_per_rollout: int
    """Mini-batches (optimizer steps) per pass over a rollout."""
    num_epochs: int = 1
    """Passes over a rollout."""

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.num_steps_per_rollout * self.num_epochs


def samples_per_rollout(rollout_section: Any, data_source: str) -> int:
    """Samples a rollout step nominally trains on: prompts x samples per prompt, or dataset rows."""
    per_prompt = rollout_section.n_samples_per_prompt if data_source == "rollout" else 1
    return rollout_section.rollout_batch_size * per_prompt


def resolve_mini_batch_schedule(rollout_section: Any, train_section: Any, *, data_source: str = "rollout"
                                ) -> MiniBatchSchedule:
    """The run's `MiniBatchSchedule` from --global-batch-size / --num-steps-per-rollout / --num-epochs;
    raises ConfigError naming the flags and the fix when they do not fit the rollout."""
    total = samples_per_rollout(rollout_section, data_source)
    what = ("--rollout-batch-size x --n-samples-per-prompt" if data_source == "rollout" else "--rollout-batch-size")
    size, steps = train_section.global_batch_size, train_section.num_steps_per_rollout
    epochs = train_section.num_epochs
    if size is None and steps is None:
        return MiniBatchSchedule(global_batch_size=total, num_steps_per_rollout=1, num_epochs=epochs)
    if size is None:
        if total % steps:
            raise ConfigError(f"--num-steps-per-rollout {steps} does not divide the {total} samples of a rollout "
                              f"({what}); pick a divisor of {total}, or give --global-batch-size instead")
        return MiniBatchSchedule(global_batch_size=total // steps, num_steps_per_rollout=steps, num_epochs=epochs)
    if steps is None:
        if total % size:
            raise ConfigError(f"--global-batch-size {size} does not divide the {total} samples of a rollout "
                              f"({what}); pick a divisor of {total}, or change --rollout-batch-size")
        return MiniBatchSchedule(global_batch_size=size, num_steps_per_rollout=total // size, num_epochs=epochs)
    if size * steps != total:
        raise ConfigError(f"--global-batch-size {size} x --num-steps-per-rollout {steps} = {size * steps} samples, "
                          f"but a rollout holds {total} ({what}); they must be equal: give only one of the two "
                          "flags (the other is derived) or fix one of them")
    return MiniBatchSchedule(global_batch_size=size, num_steps_per_rollout=steps, num_epochs=epochs)


def with_resolved_mini_batches(run_config: RunConfig, data_source: str) -> RunConfig:
    """The run config with both --global-batch-size and --num-steps-per-rollout filled in (derived when
    unset): what the role workers, the loop and the saved run_config.json read. Resolving it again
    gives the same values."""
    schedule = resolve_mini_batch_schedule(run_config.rollout, run_config.train, data_source=data_source)
    train = dataclasses.replace(run_config.train, global_batch_size=schedule.global_batch_size,
                                num_steps_per_rollout=schedule.num_steps_per_rollout)
    return dataclasses.replace(run_config, train=train)


def optimizer_steps_per_rollout(train_section: Any) -> int:
    """num_steps_per_rollout x num_epochs of a resolved train section (`with_resolved_mini_batches`); an
    unset num_steps_per_rollout counts as 1 only when global_batch_size is unset too."""
    steps = train_section.num_steps_per_rollout
    if steps is None:
        if train_section.global_batch_size is not None:
            raise ValueError("optimizer_steps_per_rollout needs a resolved train section (with_resolved_mini_batches): "
                             "--global-batch-size is set and --num-steps-per-rollout is not derived yet")
        steps = 1
    return steps * train_section.num_epochs


def num_optimizer_steps(train_section: Any) -> int:
    """Optimizer steps of the whole run, num_steps x num_steps_per_rollout x num_epochs: what the LR
    schedule counts (see `optimizer_steps_per_rollout`)."""
    return train_section.num_steps * optimizer_steps_per_rollout(train_section)


def sample_groups(prompt_ids: Sequence[Any] | None, pair_ids: Sequence[Any] | None, num_samples: int
                  ) -> tuple[list[list[int]], bool]:
    """(groups of sample indices in first-seen order, whether a group must stay whole): DPO pairs
    (whole), else prompt groups (may straddle a cut), else single samples."""
    keys, whole = (pair_ids, True) if pair_ids is not None else (prompt_ids, False)
    if keys is None:
        return [[i] for i in range(num_samples)], False
    groups: dict[Any, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return list(groups.values()), whole


def mini_batch_indices(groups: Sequence[Sequence[int]], *, num_steps_per_rollout: int, num_epochs: int, seed: int,
                       rollout_step: int, keep_groups_whole: bool = False) -> list[list[int]]:
    """Sample indices of each optimizer step of one rollout, in order (num_epochs x num_steps_per_rollout
    lists; see the module docstring)."""
    num_samples = sum(len(group) for group in groups)
    if num_samples < num_steps_per_rollout or (keep_groups_whole and len(groups) < num_steps_per_rollout):
        raise ValueError(f"the rollout of step {rollout_step} holds {num_samples} samples in {len(groups)} groups, "
                         f"fewer than --num-steps-per-rollout {num_steps_per_rollout}; lower it or raise "
                         "--rollout-batch-size")
    steps = []
    for epoch in range(num_epochs):
        order = list(groups)
        random.Random(f"{seed}:{rollout_step}:{epoch}").shuffle(order)
        flat = [index for group in order for index in group]
        cuts = [round(k * num_samples / num_steps_per_rollout) for k in range(num_steps_per_rollout + 1)]
        if keep_groups_whole:
            ends = _group_ends([len(group) for group in order])
            cuts = [0] + [min(end for end in ends if end >= cut) for cut in cuts[1:]]
        slices = [flat[begin:end] for begin, end in zip(cuts, cuts[1:])]
        if any(not indices for indices in slices):
            raise ValueError(f"the rollout of step {rollout_step} cannot be cut into {num_steps_per_rollout} "
                             "non-empty mini-batches of whole pairs; lower --num-steps-per-rollout")
        steps += slices
    return steps


def _group_ends(sizes: Sequence[int]) -> list[int]:
    ends, position = [], 0
    for size in sizes:
        position += size
        ends.append(position)
    return ends
