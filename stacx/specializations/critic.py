"""Value model for PPO: regresses per-token values onto returns.

The loss body arrives with the specializations work; this module fixes the class name and
its place in the recipe catalog (stacx.trainer.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.specializations.base import Specialization


class CriticSpecialization(Specialization):
    """Value model for PPO: regresses per-token values onto returns.

    Per response token: loss_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t +- eps) - R_t)^2). The model
    output is values [tokens_local] (a value head instead of the language-model head).
    """

    outputs_values = True

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError("CriticSpecialization.compute_loss arrives with the specializations work")
