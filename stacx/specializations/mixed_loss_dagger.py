"""Mixed-loss DAgger-OPD: cross-entropy on teacher-executed tokens, k3 reverse KL on student-executed ones.

The loss body arrives with the specializations work; this module fixes the class name and
its place in the recipe catalog (stacx.trainer.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.specializations.base import Specialization


class MixedLossDaggerOPDSpecialization(Specialization):
    """Mixed-loss DAgger-OPD: cross-entropy on teacher-executed tokens, k3 reverse KL on student-executed ones.

    Per action token: teacher-executed (marked by a +1.0 sentinel in `teacher_log_probs`, since real
    log-probs are <= 0) -> loss_t = -log pi(a_t); student-executed -> the k3 reverse-KL term of
    DistillSpecialization. Logs ce_mean, k3_mean and teacher_action_frac.
    """

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError("MixedLossDaggerOPDSpecialization.compute_loss arrives with the specializations work")
