"""Process groups of one role's (tp, cp, dp) layout, passed explicitly to everything below.

megatron-core keeps its groups in module globals (`parallel_state`); Stacx reads them once,
right after `initialize_parallel_layout`, into a frozen `ProcessGroups` that code receives as
an argument. Nothing under `stacx/parallel` looks a group up on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stacx.parallel.collectives import group_rank, group_size


@dataclass(frozen=True)
class ProcessGroups:
    """The groups one rank belongs to. `None` groups stand for a size-1 axis (single process)."""

    tp: dist.ProcessGroup | None
    """Tensor-parallel group: ranks that hold shards of the same weights (vocab shards of the logits)."""
    cp: dist.ProcessGroup | None
    """Context-parallel group: ranks that hold chunks of the same sequences."""
    dp: dist.ProcessGroup | None
    """Data-parallel group: ranks that hold different samples."""
    dp_cp: dist.ProcessGroup | None
    """DP x CP group: ranks whose gradients are summed together (the loss normalization group)."""
    pp: dist.ProcessGroup | None = None
    """Pipeline-parallel group: ranks that hold consecutive stages (layer ranges) of the same model."""

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp)

    @property
    def dp_cp_size(self) -> int:
        return group_size(self.dp_cp)

    @property
    def dp_cp_rank(self) -> int:
        return group_rank(self.dp_cp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def pp_rank(self) -> int:
        return group_rank(self.pp)

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the embedding (the first pipeline stage; always true without PP)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the final norm and the LM head: the loss and log-probs are computed here."""
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def single_process(cls) -> "ProcessGroups":
        """Groups for a run without torch.distributed: every axis has size 1."""
        return cls(tp=None, cp=None, dp=None, dp_cp=None)


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed_from_env(timeout_s: float = 600.0) -> None:
    """Initialize the default process group from torchrun / Ray style env vars (RANK, WORLD_SIZE, ...)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"cannot initialize torch.distributed: environment variables {missing} are not set")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=default_backend(), timeout=timedelta(seconds=timeout_s))


def initialize_parallel_layout(
    tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    *,
    pipeline_parallel_size: int = 1,
    timeout_s: float = 600.0,
) -> ProcessGroups:
    """Build megatron-core's model-parallel groups for (tp, cp, pp, dp) and return them explicitly.

    The world size must be a multiple of tp * cp * pp; dp is what remains. Must be called on every
    rank after the default process group exists.
    """
    from megatron.core import parallel_state

    from stacx.parallel import megatron_cpu_compat

    world_size = dist.get_world_size()
    model_parallel = tensor_parallel_size * context_parallel_size * pipeline_parallel_size
    if min(tensor_parallel_size, context_parallel_size, pipeline_parallel_size) < 1:
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}), context_parallel_size "
            f"({context_parallel_size}) and pipeline_parallel_size ({pipeline_parallel_size}) must be >= 1"
        )
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_parallel_size * context_parallel_size * "
            f"pipeline_parallel_size = {tensor_parallel_size} * {context_parallel_size} * {pipeline_parallel_size}"
        )
    megatron_cpu_compat.apply_if_needed()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        context_parallel_size=context_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        create_gloo_process_groups=True,
    )
    return ProcessGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        cp=parallel_state.get_context_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        pp=parallel_state.get_pipeline_model_parallel_group() if pipeline_parallel_size > 1 else None,
    )


def destroy_parallel_layout() -> None:
    """Tear down megatron-core's groups and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
