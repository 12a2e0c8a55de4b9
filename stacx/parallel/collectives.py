"""Thin wrappers over the few collectives Stacx issues, each named after what it does.

Everything else in `stacx/parallel` is math on local tensors; these are the only places that
talk to other ranks. A `None` group stands for a size-1 axis: every wrapper is then the
identity and issues nothing, so single-process code takes the same path.

Forward/backward pairs (autograd) follow megatron's naming style:
`GatherFromContextParallel`: forward all-gather, backward reduce-scatter of the gradient (NCCL's
reduce-scatter; gloo has none, so there an all-reduce followed by keeping this rank's slice).
Used for CP response gathering (cp_fields) and for K/V gathering in CP attention (models).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_flat(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """all-gather of 1-D tensors into one flat output (torch's newer name when it has it)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def all_gather_stacked(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `tensor` stacked in group-rank order: [world, *tensor.shape]. One collective.

    Not differentiable (see `GatherFromContextParallel` for the autograd version).
    """
    world = group_size(group)
    if world == 1:
        return tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    # A flat output works on every backend (gloo rejects a [world, n] output shape).
    flat = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    all_gather_flat(flat, tensor.reshape(-1), group=group)
    return flat.view(world, *tensor.shape)


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over the group (identity for a size-1 group). Returns `tensor`."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class GatherFromContextParallel(torch.autograd.Function):
    """Forward: all-gather [n, ...] -> [cp, n, ...]. Backward: sum the gradient over CP, keep own slice.

    The gathered tensor is a replica on every CP rank. Every rank's loss may use all of it; the
    backward sum routes each rank's contribution to the rank that owns the values, so the
    total gradient is that of the sum of all ranks' losses (see docs/parallel.md).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_gather_stacked(local, group)

    @staticmethod
    def backward(ctx, grad_gathered: torch.Tensor):
        group = ctx.group
        if group_size(group) > 1 and dist.get_backend(group) == "nccl":
            grad_local = torch.empty_like(grad_gathered[0])
            dist.reduce_scatter_tensor(grad_local, grad_gathered.contiguous(), group=group)
            return grad_local, None
        # clone: the incoming gradient may be shared with other autograd branches; never reduce it in place.
        grad = all_reduce_sum_(grad_gathered.contiguous().clone(), group)
        return grad[group_rank(group)], None


def gather_from_context_parallel(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-gather over CP: [n, ...] -> [cp, n, ...] (see GatherFromContextParallel)."""
    return GatherFromContextParallel.apply(local, group)
