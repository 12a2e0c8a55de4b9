"""A critic's value head in a torch_dist folder (a Stacx run's critic role, `roles/critic/model`).

A critic saves its value head where a language model keeps its head: `output_layer.weight` [1, hidden] and
`output_layer.bias` [1] (replicated, not vocab-parallel). A language model's folder has `output_layer.weight`
[vocab, hidden] (or none, with tied embeddings) and no bias: it holds no value head.

    head = read_torch_dist_value_head(folder, hidden_size)   # (weight, bias) or None; collective

The decoder of a critic is loaded without its language-model head (`load_torch_dist(..., value_head=True)`); the
head is read apart, after the critic's `ValueHead` replaced that layer.
"""

from __future__ import annotations

import os

import torch

VALUE_HEAD_WEIGHT = "output_layer.weight"
VALUE_HEAD_BIAS = "output_layer.bias"


def holds_torch_dist_value_head(folder: str | os.PathLike, hidden_size: int) -> bool:
    """Whether torch_dist `folder` holds a value head ([1, hidden] weight and a [1] bias under output_layer)."""
    from stacx.checkpointing.torch_dist import _checkpoint_shapes

    shapes = _checkpoint_shapes(folder)
    return shapes.get(VALUE_HEAD_WEIGHT) == (1, hidden_size) and shapes.get(VALUE_HEAD_BIAS) == (1,)


@torch.no_grad()
def read_torch_dist_value_head(folder: str | os.PathLike, hidden_size: int,
                               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight [1, hidden], bias [1]) of the value head in torch_dist `folder`, or None when it holds none.
    Collective over the default process group (every rank reads the whole, replicated head)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    if not holds_torch_dist_value_head(folder, hidden_size):
        return None
    state = {"weight": ShardedTensor.from_rank_offsets(VALUE_HEAD_WEIGHT, torch.empty(1, hidden_size, dtype=dtype)),
             "bias": ShardedTensor.from_rank_offsets(VALUE_HEAD_BIAS, torch.empty(1, dtype=dtype))}
    loaded = dist_checkpointing.load(state, os.fspath(folder))
    return loaded["weight"], loaded["bias"]


__all__ = ["VALUE_HEAD_BIAS", "VALUE_HEAD_WEIGHT", "holds_torch_dist_value_head", "read_torch_dist_value_head"]
