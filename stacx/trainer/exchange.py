"""Exchange syncs in the training loop: after the train phase, tensors move from one role's ranks
to another's over the sync's `ExchangeSyncGroup` (gloo on CPU, NCCL on GPU), bit for bit.

    schedule = ExchangeSchedule(training_config, exchanges, roles, every_n_steps_override=0)
    metrics = schedule.run_due(completed_steps)          # after every optimizer step

A sync runs when `completed_steps % every_n_steps == 0` (the run's `exchange_every_n_steps`
overrides each sync's own value when > 0), so a resumed run exchanges on the same steps.

What moves is named by the sync's `keys`; each key is an `ExchangePayload`
(`stacx.trainer.runtime.exchange_payloads`): `produce` runs on every source rank (collectively:
it may gather over TP), `consume` on every target rank.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

from stacx.trainer.cluster.protocol import ExchangeGroup, RoleGroup
from stacx.trainer.config.layout import RankCoords
from stacx.trainer.config.recipe import TrainingConfig
from stacx.trainer.runtime.exchange_payloads import EXCHANGE_PAYLOADS


def check_exchange_syncs(training_config: TrainingConfig) -> None:
    """Every exchange key is known and fits its roles; ValueError naming the recipe, sync and key."""
    for sync in training_config.role_graph().exchange_syncs:
        for key in sync.keys:
            payload = EXCHANGE_PAYLOADS.get(key)
            if payload is None:
                raise ValueError(
                    f"recipe {training_config.name!r}: exchange sync {sync.source_role} -> {sync.target_role} names "
                    f"key {key!r}, which the training loop cannot move; known keys: {', '.join(sorted(EXCHANGE_PAYLOADS))}"
                )
            payload.check(sync, training_config.role(sync.source_role), training_config.role(sync.target_role))


def sources_by_target(source_coords: Sequence[RankCoords], num_target_ranks: int, *, tp_rank0_only: bool) -> list[int]:
    """Target rank j receives from the j-th sender, round robin; senders are the source ranks with
    tp = cp = 0 (one per DP replica, which holds the gathered full tensors), or every rank."""
    senders = [rank for rank, c in enumerate(source_coords)
               if not tp_rank0_only or (c.tp_rank == 0 and c.cp_rank == 0)]
    return [senders[j % len(senders)] for j in range(num_target_ranks)]


class ExchangeSchedule:
    """Runs a recipe's exchange syncs after the train phase, every `every_n_steps` steps."""

    def __init__(self, training_config: TrainingConfig, exchanges: Mapping[str, ExchangeGroup] | None,
                 roles: Mapping[str, RoleGroup], *,
                 every_n_steps_override: int = 0):
        self.syncs = training_config.role_graph().exchange_syncs
        if every_n_steps_override < 0:
            raise ValueError(f"exchange_every_n_steps must be >= 0, got {every_n_steps_override}")
        self.every_n_steps_override = every_n_steps_override
        if not self.syncs:
            self.groups = {}
            return
        check_exchange_syncs(training_config)
        exchanges = exchanges or {}
        missing = [s.name for s in self.syncs if s.name not in exchanges]
        if missing:
            raise NotImplementedError(
                f"recipe {training_config.name!r}: exchange syncs {missing} are not connected; they run on Ray role "
                "workers (create_trainer), not in a torchrun SPMD job"
            )
        self.groups = {s.name: exchanges[s.name] for s in self.syncs}
        self.source_coords = {s.source_role: roles[s.source_role].coords for s in self.syncs}
        self.target_coords = {s.target_role: roles[s.target_role].coords for s in self.syncs}

    def interval(self, sync) -> int:
        return self.every_n_steps_override or sync.every_n_steps

    def is_due(self, sync, completed_steps: int) -> bool:
        return completed_steps > 0 and completed_steps % self.interval(sync) == 0

    def run_due(self, completed_steps: int) -> dict[str, float]:
        """Run every sync due after `completed_steps` optimizer steps; returns exchange metrics."""
        metrics: dict[str, float] = {}
        for sync in self.syncs:
            if not self.is_due(sync, completed_steps):
                continue
            name = sync.name
            group = self.groups[name]
            keys = tuple(sync.keys)
            mapping = sources_by_target(
                self.source_coords[sync.source_role], len(self.target_coords[sync.target_role]),
                tp_rank0_only=any(EXCHANGE_PAYLOADS[k].senders_need_tp_rank0 for k in keys))
            started = time.monotonic()
            consumed = group.transfer_payloads(keys, sources_by_target=mapping)
            metrics[f"exchange/{name}/time_s"] = time.monotonic() - started
            for key in keys:
                counts = {result[key] for result in consumed}
                metrics[f"exchange/{name}/{key}_tensors"] = float(min(counts))
        return metrics
