"""The collective context-parallel attention needs: gather every CP rank's K/V chunks.

    gathered = all_gather_with_grad(local, group)   # [cp, *local.shape]

Forward: all-gather along a new leading dim. Backward: every rank's gradient for the gathered
tensor is summed over the group and each rank keeps its own slot (a reduce-scatter). gloo has
no reduce-scatter, so there it is an all-reduce followed by a slice; NCCL uses the real one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: all-gather into [group_size, ...]; backward: reduce-scatter back to [...]."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx, grad_gathered: torch.Tensor):
        group = ctx.group
        rank = dist.get_rank(group)
        grad_gathered = grad_gathered.contiguous()
        if dist.get_backend(group) == "nccl":
            grad_local = torch.empty_like(grad_gathered[0])
            dist.reduce_scatter_tensor(grad_local, grad_gathered, group=group)
            return grad_local, None
        dist.all_reduce(grad_gathered, group=group)
        return grad_gathered[rank].clone(), None


def all_gather_with_grad(local: torch.Tensor, group) -> torch.Tensor:
    """Stack `local` from every rank of `group` into [group_size, *local.shape], differentiably."""
    if group is None or dist.get_world_size(group) == 1:
        return local.unsqueeze(0)
    return _AllGatherWithGrad.apply(local, group)
