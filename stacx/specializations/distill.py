"""On-policy distillation: reverse KL from the student to a frozen teacher server.

The loss body arrives with the specializations work; this module fixes the class name and
its place in the recipe catalog (stacx.trainer.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.specializations.base import Specialization


class DistillSpecialization(Specialization):
    """On-policy distillation: reverse KL from the student to a frozen teacher server.

    Per student-sampled token a_t: the k3 estimate of KL(pi_student || pi_teacher),
    r_t = exp(log pi_teacher(a_t) - log pi(a_t)); loss_t = r_t - 1 - log r_t. Teacher log-probs
    arrive as the rollout field `teacher_log_probs`.
    """

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError("DistillSpecialization.compute_loss arrives with the specializations work")
