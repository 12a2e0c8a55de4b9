"""Process groups of one role's (tp, cp, dp) layout, and its expert (ep, etp) layout, passed explicitly.

megatron-core keeps its groups in module globals (`parallel_state`); Stacx reads them once,
right after `initialize_parallel_layout`, into a frozen `ProcessGroups` that code receives as
an argument. Nothing under `stacx/parallel` looks a group up on its own.

Mixture-of-experts layers see the same world through a second grid (megatron's "expert" groups):
the attention layers are sharded tp x cp x dp, the routed experts etp x ep x edp, where
etp * ep * edp = tp * cp * dp. A rank holds num_experts / ep experts, each sharded over etp; edp is
what is left, the ranks that hold the same expert shard and sum its gradients.
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
    ep: dist.ProcessGroup | None = None
    """Expert-parallel group: ranks that hold different experts of the same MoE layer."""
    etp: dist.ProcessGroup | None = None
    """Expert-tensor-parallel group: ranks that hold shards of the same experts."""
    edp: dist.ProcessGroup | None = None
    """Expert-data-parallel group: ranks that hold the same expert shard (its gradients are summed over it)."""
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
    def ep_size(self) -> int:
        return group_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep)

    @property
    def etp_size(self) -> int:
        return group_size(self.etp)

    @property
    def etp_rank(self) -> int:
        return group_rank(self.etp)

    @property
    def edp_size(self) -> int:
        return group_size(self.edp)

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


def check_expert_layout(world_size: int, tensor_model_parallel_size: int, expert_model_parallel_size: int,
                        expert_tensor_parallel_size: int) -> None:
    """Raise naming the flags when ep x etp does not divide the world (megatron's expert grid)."""
    if expert_model_parallel_size < 1 or expert_tensor_parallel_size < 1:
        raise ValueError(f"--expert-model-parallel-size ({expert_model_parallel_size}) and --expert-tensor-parallel-size "
                         f"({expert_tensor_parallel_size}) must be >= 1")
    if world_size % (expert_model_parallel_size * expert_tensor_parallel_size):
        raise ValueError(
            f"world size {world_size} is not divisible by --expert-model-parallel-size * --expert-tensor-parallel-size "
            f"= {expert_model_parallel_size} * {expert_tensor_parallel_size}; choose sizes whose product divides the "
            "role's ranks")


def initialize_parallel_layout(
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    pipeline_model_parallel_size: int = 1,
    timeout_s: float = 600.0,
) -> ProcessGroups:
    """Build megatron-core's model-parallel groups for (tp, cp, pp, dp) and the expert grid (etp, ep, edp),
    and return them explicitly.

    The world size must be a multiple of tp * cp * pp; dp is what remains. Each pipeline stage's ranks
    must also be a multiple of ep * etp (etp defaults to tp, megatron's default); edp is what remains
    there. Must be called on every rank after the default process group exists.
    """
    from stacx.parallel.megatron_import import import_megatron_core

    import_megatron_core()  # most processes import megatron-core first here
    from megatron.core import parallel_state

    from stacx.parallel import megatron_cpu_compat

    world_size = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size
    if min(tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size) < 1:
        raise ValueError(
            f"tensor_model_parallel_size ({tensor_model_parallel_size}), context_parallel_size "
            f"({context_parallel_size}) and pipeline_model_parallel_size ({pipeline_model_parallel_size}) must be >= 1"
        )
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size * context_parallel_size * "
            f"pipeline_model_parallel_size = {tensor_model_parallel_size} * {context_parallel_size} * {pipeline_model_parallel_size}"
        )
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    check_expert_layout(world_size // pipeline_model_parallel_size, tensor_model_parallel_size, expert_model_parallel_size,
                        expert_tensor_parallel_size)
    megatron_cpu_compat.apply_if_needed()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        create_gloo_process_groups=True,
    )
    return ProcessGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        cp=parallel_state.get_context_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        ep=parallel_state.get_expert_model_parallel_group(),
        etp=parallel_state.get_expert_tensor_parallel_group(),
        edp=parallel_state.get_expert_data_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group() if pipeline_model_parallel_size > 1 else None,
    )


def destroy_parallel_layout() -> None:
    """Tear down megatron-core's groups and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
