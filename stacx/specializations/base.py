"""The interface every specialization implements.

A role worker calls `compute_loss` once per packed micro-batch, after the forward pass:

    loss, metrics = specialization.compute_loss(model_output, batch, reducer)

- `model_output`: the TP-local logits shard [tokens_local, vocab/tp] of this CP rank's slice
  of the packed micro-batch (values [tokens_local] for a critic).
- `batch`: the packed micro-batch fields, already sliced for this CP rank (see
  stacx.parallel): `tokens`, `response_lengths`, `loss_masks`, log-prob fields, advantages...
- `reducer`: applies the framework's CP-aware, split-invariant reduction (one contract for
  every loss: a sum divided by a global count known before the first backward).

A specialization composes stateless kernels (stacx.objectives) with the vocab-parallel and CP
utilities (stacx.parallel). It issues no collectives of its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class Specialization:
    """Base class: per-algorithm loss assembly for one role."""

    #: Whether the role's model outputs a value per token (critic) instead of logits.
    outputs_values: bool = False

    def __init__(self, config: Any = None, groups: Any = None):
        self.config = config
        self.groups = groups

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss")
