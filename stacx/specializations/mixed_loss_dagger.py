"""Mixed-loss DAgger-OPD: cross-entropy on teacher-executed tokens, k3 reverse KL on student-executed ones."""

from __future__ import annotations

import torch

from stacx.objectives.distillation import TEACHER_EXECUTED_SENTINEL
from stacx.objectives.registry import get_loss
from stacx.specializations.base import NUM_LOSS_TOKENS, LossTerms, Specialization
from stacx.specializations.distill import check_teacher_log_probs

NUM_TEACHER_TOKENS = "num_teacher_tokens"
NUM_STUDENT_TOKENS = "num_student_tokens"


class MixedLossDaggerOPDSpecialization(Specialization):
    """Mixed-loss DAgger-OPD: cross-entropy on teacher-executed tokens, k3 reverse KL on student-executed ones.

    Per action token: teacher-executed (marked by the +1.0 sentinel in `teacher_log_probs`, since
    real log-probs are <= 0) -> loss_t = -log pi(a_t); student-executed -> the k3 reverse-KL term
    of DistillSpecialization (objective `distill_mixed`). All teacher tokens give exactly the
    CausalDecoderSpecialization loss, all student tokens exactly the k3 DistillSpecialization loss.

    Batch: `loss_masks`, `teacher_log_probs`. Per-token only: no CP communication.
    Logged (metric_means): ce_mean (CE per teacher token), k3_mean (K3 per student token),
    teacher_action_frac (teacher tokens / loss tokens).
    """

    base_required_fields = ("teacher_log_probs",)
    metric_denominators = {
        "ce_mean": NUM_TEACHER_TOKENS,
        "k3_mean": NUM_STUDENT_TOKENS,
        "teacher_action_frac": NUM_LOSS_TOKENS,
    }

    def check_fields(self, batch) -> None:
        check_teacher_log_probs(batch, batch.layout, "teacher_log_probs", allow_sentinel=True)

    def per_token_terms(self, view, batch) -> LossTerms:
        teacher, masks = view.cut(batch.teacher_log_probs), view.loss_masks
        per_token, metrics = get_loss("distill_mixed")(self.config, view.values, teacher, masks)
        teacher_tokens = sum(((u == TEACHER_EXECUTED_SENTINEL) & (m != 0)).sum() for u, m in zip(teacher, masks))
        student_tokens = sum(((u != TEACHER_EXECUTED_SENTINEL) & (m != 0)).sum() for u, m in zip(teacher, masks))
        metrics[NUM_TEACHER_TOKENS] = torch.as_tensor(teacher_tokens, dtype=torch.float64)
        metrics[NUM_STUDENT_TOKENS] = torch.as_tensor(student_tokens, dtype=torch.float64)
        return LossTerms(per_token, metrics)
