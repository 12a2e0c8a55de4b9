"""Exchange syncs in the training loop: after the train phase, tensors move from one role's ranks
to another's over the sync's `ExchangeSyncGroup` (gloo on CPU, NCCL on GPU), bit for bit.

    schedule = ExchangeSchedule(training_config, exchanges, roles, every_n_steps_override=0)
    metrics = schedule.run_due(completed_steps)          # after every optimizer step

A sync runs when `completed_steps % every_n_steps == 0` (the run's `exchange_every_n_steps`
overrides each sync's own value when > 0), so a resumed run exchanges on the same steps.

What moves is named by the sync's `keys`; each key is an `ExchangePayload` here: a `produce`
function run on every source rank (collectively: it may gather over TP) and a `consume`
function run on every target rank. Both are shipped to the Ray workers and find the rank's
`RoleRuntime` in `worker.state`.

- `weights`: the source model's parameters as full Hugging Face-named tensors (gathered over TP
  on the ranks with cp = 0; TP rank 0 of each DP replica sends), loaded by every target rank into
  its own TP shard. Source and target may use different layouts (e.g. a TP=2 policy into a TP=1,
  DP=2 reference). The target must be frozen (a trainable target's optimizer would keep stale
  master weights) and both roles need a language-model head.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

WEIGHTS_KEY = "weights"
KEY_SEPARATOR = "/"
"""Tensor names in a transfer are `<key>/<name>`, so one sync can move several payloads."""
PRODUCE_BUCKET_BYTES = 256 * 1024 * 1024
"""Bucket size of the TP gathers that assemble full tensors on the sending ranks."""


@dataclass(frozen=True)
class ExchangePayload:
    """What one exchange key moves: `produce(runtime) -> {name: tensor}` on every source rank,
    `consume(runtime, {name: tensor}) -> int` (tensors used) on every target rank."""

    key: str
    produce: Callable[[Any], dict[str, torch.Tensor]]
    consume: Callable[[Any, Mapping[str, torch.Tensor]], int]
    check: Callable[[Any, Any, Any], None]
    """check(sync, source_role, target_role): raise ValueError when the recipe cannot use this payload."""
    senders_need_tp_rank0: bool = True
    """Whether only TP rank 0 (cp = 0) of each source DP replica holds the produced tensors."""


# ---- the `weights` payload --------------------------------------------------------------------


def produce_hf_weights(runtime) -> dict[str, torch.Tensor]:
    """Full Hugging Face-named tensors on TP rank 0 of each (cp = 0) replica; {} on the others,
    which only take part in the TP gathers."""
    if runtime.groups.cp_rank != 0:
        return {}
    tensors: dict[str, torch.Tensor] = {}
    for bucket in runtime.weight_buckets(PRODUCE_BUCKET_BYTES, only_to_tp_rank=0):
        tensors.update(bucket)
    return tensors


@torch.no_grad()
def consume_hf_weights(runtime, tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy full Hugging Face-named tensors into this rank's TP shard; every parameter must arrive."""
    from stacx.rollout.engines.weight_loading import HfWeightReceiver

    receiver = HfWeightReceiver(runtime.model, runtime.groups)
    expected = set(receiver.targets)
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"role {runtime.role.name!r}: weight exchange is missing tensors {missing[:3]}"
                         + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""))
    receiver.receive(list(tensors.items()))
    receiver.check_complete()
    return len(tensors)


def check_weights_exchange(sync, source, target) -> None:
    where = f"exchange sync {source.name} -> {target.name} (keys {list(sync.keys)})"
    if target.trainable:
        raise ValueError(f"{where}: 'weights' can only be loaded into a frozen role; {target.name!r} is trainable "
                         "(its optimizer would keep its own copy of the weights)")
    for role in (source, target):
        if role.outputs_values:
            raise ValueError(f"{where}: role {role.name!r} has a value head; 'weights' moves language-model weights")


EXCHANGE_PAYLOADS: dict[str, ExchangePayload] = {
    WEIGHTS_KEY: ExchangePayload(WEIGHTS_KEY, produce_hf_weights, consume_hf_weights, check_weights_exchange),
}
"""Exchange keys the loop can move, by name."""


# ---- functions shipped to the workers -----------------------------------------------------------


def _runtime(worker):
    from stacx.trainer.runtime.calls import RUNTIME_KEY

    runtime = worker.state.get(RUNTIME_KEY)
    if runtime is None:
        raise RuntimeError(f"role {worker.role_name!r} rank {worker.rank}: no runtime built (build_runtime first)")
    return runtime


def produce_on_worker(worker, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every key's tensors, named `<key>/<name>` (runs on every source rank)."""
    runtime = _runtime(worker)
    out = {}
    for key in keys:
        for name, tensor in EXCHANGE_PAYLOADS[key].produce(runtime).items():
            out[f"{key}{KEY_SEPARATOR}{name}"] = tensor
    return out


def consume_on_worker(worker, tensors: Mapping[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, int]:
    """Hand each key its tensors (runs on every target rank); returns {key: tensors used}."""
    runtime = _runtime(worker)
    by_key: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
    for full_name, tensor in tensors.items():
        key, _, name = full_name.partition(KEY_SEPARATOR)
        if key not in by_key:
            raise ValueError(f"role {runtime.role.name!r}: exchange delivered {full_name!r}, not one of the keys {keys}")
        by_key[key][name] = tensor
    return {key: EXCHANGE_PAYLOADS[key].consume(runtime, by_key[key]) for key in keys}


# ---- the driver side ----------------------------------------------------------------------------


def check_exchange_syncs(training_config) -> None:
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


def sources_by_target(source_coords: list[dict], num_target_ranks: int, *, tp_rank0_only: bool) -> list[int]:
    """Target rank j receives from the j-th sender, round robin; senders are the source ranks with
    tp = cp = 0 (one per DP replica, which holds the gathered full tensors), or every rank."""
    senders = [rank for rank, c in enumerate(source_coords)
               if not tp_rank0_only or (c["tp_rank"] == 0 and c["cp_rank"] == 0)]
    return [senders[j % len(senders)] for j in range(num_target_ranks)]


class ExchangeSchedule:
    """Runs a recipe's exchange syncs after the train phase, every `every_n_steps` steps."""

    def __init__(self, training_config, exchanges: Mapping[str, Any] | None, roles: Mapping[str, Any], *,
                 every_n_steps_override: int = 0):
        from stacx.trainer.factory import exchange_name

        self.syncs = training_config.role_graph().exchange_syncs
        if every_n_steps_override < 0:
            raise ValueError(f"exchange_every_n_steps must be >= 0, got {every_n_steps_override}")
        self.every_n_steps_override = every_n_steps_override
        if not self.syncs:
            self.groups = {}
            return
        check_exchange_syncs(training_config)
        exchanges = exchanges or {}
        missing = [exchange_name(s) for s in self.syncs if exchange_name(s) not in exchanges]
        if missing:
            raise NotImplementedError(
                f"recipe {training_config.name!r}: exchange syncs {missing} are not connected; they run on Ray role "
                "workers (create_trainer), not in a torchrun SPMD job"
            )
        self.groups = {exchange_name(s): exchanges[exchange_name(s)] for s in self.syncs}
        self.source_coords = {s.source_role: roles[s.source_role].coords for s in self.syncs}

    def interval(self, sync) -> int:
        return self.every_n_steps_override or sync.every_n_steps

    def is_due(self, sync, completed_steps: int) -> bool:
        return completed_steps > 0 and completed_steps % self.interval(sync) == 0

    def run_due(self, completed_steps: int) -> dict[str, float]:
        """Run every sync due after `completed_steps` optimizer steps; returns exchange metrics."""
        from stacx.trainer.factory import exchange_name

        metrics: dict[str, float] = {}
        for sync in self.syncs:
            if not self.is_due(sync, completed_steps):
                continue
            name = exchange_name(sync)
            group = self.groups[name]
            keys = tuple(sync.keys)
            mapping = sources_by_target(
                self.source_coords[sync.source_role], group.target.num_ranks,
                tp_rank0_only=any(EXCHANGE_PAYLOADS[k].senders_need_tp_rank0 for k in keys))
            started = time.monotonic()
            consumed = group.transfer(functools.partial(produce_on_worker, keys=keys),
                                      functools.partial(consume_on_worker, keys=keys), sources_by_target=mapping)
            metrics[f"exchange/{name}/time_s"] = time.monotonic() - started
            for key in keys:
                counts = {result[key] for result in consumed}
                metrics[f"exchange/{name}/{key}_tensors"] = float(min(counts))
        return metrics
