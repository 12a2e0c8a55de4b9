"""Where ranks sit: one role's parallel layout (`RoleLayout`) and one rank's place in it (`RankCoords`).

The factory resolves a `RoleLayout` per role, the loop plans micro-batches by it, each rank
reports its `RankCoords`, and a checkpoint records both (so a resume can check or remap them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


MODEL_PARALLEL_SIZE_FIELDS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                              "expert_model_parallel_size", "expert_tensor_parallel_size")


@dataclass(frozen=True, kw_only=True)
class RoleLayout:
    """How one role's ranks are laid out: world size = tp * cp * pp * dp."""

    tensor_model_parallel_size: int
    """Ranks sharding each weight matrix."""
    context_parallel_size: int
    """Ranks sharing each sequence."""
    data_parallel_size: int
    """Model replicas."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages each replica's layers are split into (1 in checkpoints written before PP existed)."""
    expert_model_parallel_size: int = 1
    """Ranks a mixture-of-experts model's routed experts are spread over (megatron's expert grid lies over
    the same ranks as tp x cp x dp; 1 for dense models and in checkpoints written before EP existed)."""
    expert_tensor_parallel_size: int | None = None
    """Ranks sharding each expert's width; None (and manifests written before EP existed): the tensor-parallel
    size, megatron's default, which the layout then holds."""

    state_replicated_across_data_parallel: bool = True
    """Whether ranks that differ only in (cp, dp) hold identical state (no distributed optimizer). Kept in the
    manifest for the record: torch_dist state loads under any layout either way."""

    def __post_init__(self) -> None:
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", self.tensor_model_parallel_size)

    @property
    def world_size(self) -> int:
        return (self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size
                * self.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def parallel_sizes(self) -> dict[str, int]:
        """The model-parallel degrees (tp, cp, pp, ep, etp) by field name: the keyword arguments a role's
        workers are started with (`RoleWorkers`); the data-parallel degree follows from their number."""
        return {name: getattr(self, name) for name in MODEL_PARALLEL_SIZE_FIELDS}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RoleLayout":
        """A manifest's layout; manifests written before the TP setting had one name say `tensor_parallel_size`."""
        values = dict(values)
        if "tensor_parallel_size" in values:
            values["tensor_model_parallel_size"] = values.pop("tensor_parallel_size")
        return cls(**values)

    def describe(self) -> str:
        pp = f" pp={self.pipeline_model_parallel_size}" if self.pipeline_model_parallel_size > 1 else ""
        ep = f" ep={self.expert_model_parallel_size}" if self.expert_model_parallel_size > 1 else ""
        return f"tp={self.tensor_model_parallel_size} cp={self.context_parallel_size}{pp} dp={self.data_parallel_size}{ep}"


@dataclass(frozen=True, kw_only=True)
class RankCoords:
    """Where a rank sits in its role's (tp, cp, pp, dp) grid."""

    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int = 0

    @classmethod
    def of(cls, groups: Any) -> "RankCoords":
        """The coordinates of the rank holding `groups` (a `stacx.parallel.groups.ProcessGroups`)."""
        return cls(tp_rank=groups.tp_rank, cp_rank=groups.cp_rank, dp_rank=groups.dp_rank, pp_rank=groups.pp_rank)
