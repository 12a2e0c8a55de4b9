"""Supervised cross-entropy on response tokens (SFT, iterative SFT / online DAgger).

The loss body arrives with the specializations work; this module fixes the class name and
its place in the recipe catalog (stacx.trainer.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.specializations.base import Specialization


class CausalDecoderSpecialization(Specialization):
    """Supervised cross-entropy on response tokens (SFT, iterative SFT / online DAgger).

    Per token t of a response: loss_t = -log pi(y_t | y_<t, x), masked by `loss_masks` and reduced by
    the framework's reducer (sum over tokens / global token count). Input: the TP-local logits
    [tokens_local, vocab/tp]; `batch['tokens']`, `response_lengths`, `loss_masks`.
    """

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError("CausalDecoderSpecialization.compute_loss arrives with the specializations work")
