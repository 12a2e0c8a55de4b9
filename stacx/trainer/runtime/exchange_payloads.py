"""Exchange payloads, per rank: what each exchange key produces on a source rank's `RoleRuntime`
and consumes on a target rank's (the schedule that runs them is `stacx.trainer.exchange`).

- `weights`: the source model's parameters as full Hugging Face-named tensors (gathered over TP
  on the ranks with cp = 0; TP rank 0 of each DP replica sends), loaded by every target rank into
  its own TP shard. Source and target may use different layouts (e.g. a TP=2 policy into a TP=1,
  DP=2 reference). The target must be frozen (a trainable target's optimizer would keep stale
  master weights) and both roles need a language-model head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from stacx.models.weight_loading import HfWeightReceiver

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
    which only take part in the TP gathers. With experts spread over ep > 1 the cp > 0 ranks take part
    in the expert gathers too (an expert-parallel group may span CP ranks) and then return {}."""
    groups = runtime.groups
    if groups.cp_rank != 0 and groups.ep_size == 1:
        return {}
    tensors: dict[str, torch.Tensor] = {}
    for bucket in runtime.weight_buckets(PRODUCE_BUCKET_BYTES, only_to_tp_rank=0):
        tensors.update(bucket)
    return tensors if groups.cp_rank == 0 else {}


@torch.no_grad()
def consume_hf_weights(runtime, tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy full Hugging Face-named tensors into this rank's TP shard; every parameter must arrive."""
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


# ---- every key of a transfer ------------------------------------------------------------------


def produce_payloads(runtime, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every key's tensors, named `<key>/<name>` (runs on every source rank)."""
    out = {}
    for key in keys:
        for name, tensor in EXCHANGE_PAYLOADS[key].produce(runtime).items():
            out[f"{key}{KEY_SEPARATOR}{name}"] = tensor
    return out


def consume_payloads(runtime, tensors: Mapping[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, int]:
    """Hand each key its tensors (runs on every target rank); returns {key: tensors used}."""
    by_key: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
    for full_name, tensor in tensors.items():
        key, _, name = full_name.partition(KEY_SEPARATOR)
        if key not in by_key:
            raise ValueError(f"role {runtime.role.name!r}: exchange delivered {full_name!r}, not one of the keys {keys}")
        by_key[key][name] = tensor
    return {key: EXCHANGE_PAYLOADS[key].consume(runtime, by_key[key]) for key in keys}
