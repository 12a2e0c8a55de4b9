"""On-policy distillation: reverse KL from the student to a frozen teacher server.

Two modes (config `distill_kl_mode`, overridden by the environment variable
STACX_DISTILL_KL_MODE, see stacx.env_overrides):

- `k3_sample` (default): the single-sample K3 estimate on the sampled token a_t,
  r_t = log pi_T(a_t) - log pi(a_t), l_t = exp(r_t) - 1 - r_t. Needs `teacher_log_probs` [R_i].
  Any TP: the student's log-prob comes from the vocab-parallel kernel.
- `topk`: exact reverse KL on the per-token support S_t = top-K_s(student) U top-K_t(teacher),
  both distributions renormalized on S_t (objective `distill_topk_reverse_kl`). The student's
  top-K over the TP-sharded vocab comes from `vocab_parallel_topk` (no grad) and its log-probs
  at the union ids from `vocab_parallel_log_probs_at_ids` (exact gradients). Needs
  `teacher_top_ids` / `teacher_top_log_probs` [R_i, K_t]. The teacher's log-prob at a student id
  it did not return is, in order: its top-K value when listed; `teacher_log_probs` when the id is
  the sampled token (if the field is present); otherwise the largest value consistent with its
  answer, min(min_k u_tk, log(1 - sum_k exp(u_tk))) (an unlisted token is no likelier than the
  least likely listed one, nor than the unlisted mass). The rule needs no vocab size, so the loss
  does not depend on TP's vocab padding.

Per-token only: no CP communication (teacher fields are sliced like the tokens).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from stacx.env_overrides import read_env_overrides
from stacx.objectives.algorithm_config import ALGORITHM_DEFAULTS, AlgorithmConfig, as_algorithm_config
from stacx.objectives.distillation import TEACHER_EXECUTED_SENTINEL, union_topk_support
from stacx.objectives.registry import get_loss
from stacx.parallel.cp_fields import PackedLayout
from stacx.parallel.lm_head import LMHeadShard
from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_at_ids
from stacx.parallel.vocab_parallel_topk import vocab_parallel_topk
from stacx.specializations.base import LossTerms, Specialization, check_response_field

DISTILL_KL_MODES = ("k3_sample", "topk")
#: Teacher log-probs above this are not log-probs (rounding of values near 0 allowed).
_LOG_PROB_TOLERANCE = 1e-4


def resolve_distill_kl_mode(config: AlgorithmConfig | None, environ: Mapping[str, str] | None = None) -> str:
    """config.distill_kl_mode; for no config (None), STACX_DISTILL_KL_MODE, else the declared default.

    A run's resolved algorithm config already carries STACX_DISTILL_KL_MODE (applied once where the
    run is resolved, stacx.trainer.config.resolve): a worker on another node must not read its
    own environment and disagree with the driver. The environment is read only without a config.
    """
    if config is not None:
        mode = as_algorithm_config(config, "resolve_distill_kl_mode(config)").distill_kl_mode
    else:
        mode = read_env_overrides(environ).get("distill_kl_mode") or ALGORITHM_DEFAULTS["distill_kl_mode"]
    if mode not in DISTILL_KL_MODES:
        raise ValueError(f"distill_kl_mode {mode!r} is not one of {list(DISTILL_KL_MODES)}")
    return mode


def check_teacher_log_probs(batch: Mapping[str, Any], layout: PackedLayout, name: str, *, allow_sentinel: bool) -> None:
    """Every entry of `batch[name]` is a log-prob (<= 0), or the +1.0 teacher-executed sentinel when
    allowed; the error names the field, the sample and the response position."""
    check_response_field(batch, name, layout)
    for index, values in enumerate(batch[name]):
        values = torch.as_tensor(values)
        bad = torch.isnan(values) | (values > _LOG_PROB_TOLERANCE)
        if allow_sentinel:
            bad &= values != TEACHER_EXECUTED_SENTINEL
        if bad.any():
            position = int(torch.nonzero(bad.reshape(values.shape[0], -1).any(-1))[0])
            hint = " (only the +1.0 teacher-executed sentinel may be positive)" if allow_sentinel else ""
            raise ValueError(
                f"batch field {name!r}: sample {index}, response token {position} holds "
                f"{values[position].tolist()}, not a log-prob{hint}"
            )


def check_teacher_top_fields(batch: Mapping[str, Any], layout: PackedLayout) -> int:
    """teacher_top_ids / teacher_top_log_probs are [R_i, K] with one K; returns K."""
    check_response_field(batch, "teacher_top_ids", layout)
    check_teacher_log_probs(batch, layout, "teacher_top_log_probs", allow_sentinel=False)
    k = None
    for index, (ids, log_probs) in enumerate(zip(batch["teacher_top_ids"], batch["teacher_top_log_probs"])):
        for name, value in (("teacher_top_ids", ids), ("teacher_top_log_probs", log_probs)):
            if value.dim() != 2 or (k is not None and value.shape[1] != k):
                raise ValueError(
                    f"batch field {name!r}: sample {index} has shape {tuple(value.shape)}, expected "
                    f"[{value.shape[0]}, {k if k is not None else 'K'}] (same K for every sample and both fields)"
                )
            k = value.shape[1]
    return int(k)


class DistillSpecialization(Specialization):
    """On-policy distillation: reverse KL from the student to a frozen teacher server.

    Per student-sampled token a_t: the k3 estimate of KL(pi_student || pi_teacher),
    r_t = exp(log pi_teacher(a_t) - log pi(a_t)); loss_t = r_t - 1 - log r_t (`k3_sample`), or
    the exact reverse KL on the union of student and teacher top-K supports (`topk`); see the
    module docstring. Config: distill_kl_mode, student_top_k (topk mode; default the teacher's
    K), distill_topk_renormalize, loss_agg_mode (token-mean).
    Metrics (sums): k3_mean and log_ratio, or topk_reverse_kl and student_support_mass.
    """

    def __init__(self, config: AlgorithmConfig | None = None, groups=None):
        super().__init__(config, groups)
        self.kl_mode = resolve_distill_kl_mode(config)  # the given config: None reads STACX_DISTILL_KL_MODE

    def required_fields(self) -> tuple[str, ...]:
        if self.kl_mode == "topk":
            return ("teacher_top_ids", "teacher_top_log_probs")
        return ("teacher_log_probs",)

    def check_fields(self, batch) -> None:
        if self.kl_mode == "topk":
            check_teacher_top_fields(batch, batch.layout)
        if self.kl_mode == "k3_sample" or batch.teacher_log_probs is not None:
            check_teacher_log_probs(batch, batch.layout, "teacher_log_probs", allow_sentinel=False)

    def needs_logits(self) -> bool:
        """`topk` reads the student's top-K from the logits shard; `k3_sample` only `token_log_probs`."""
        return self.kl_mode == "topk"

    def local_values(self, model_output: torch.Tensor, batch) -> torch.Tensor:
        """k3_sample: the student's log-prob of each sampled token [T_local]. topk: per union id
        [T_local, Ks+Kt, 3] = (student log-prob with gradient, teacher log-prob, in the support)."""
        if self.kl_mode == "topk":
            logits = model_output.logits() if isinstance(model_output, LMHeadShard) else model_output
            return self._topk_local_values(logits, batch)
        return super().local_values(model_output, batch)

    def per_token_terms(self, view, batch) -> LossTerms:
        if self.kl_mode == "topk":
            student = [v[..., 0] for v in view.values]
            teacher = [v[..., 1].detach() for v in view.values]
            support = [v[..., 2].detach() != 0 for v in view.values]
            return LossTerms(*get_loss("distill_topk_reverse_kl")(self.config, student, teacher, support, view.loss_masks))
        return LossTerms(*get_loss("distill_reverse_kl_k3")(
            self.config, view.values, view.cut(batch.teacher_log_probs), view.loss_masks))

    def _topk_local_values(self, logits: torch.Tensor, batch) -> torch.Tensor:
        layout = batch.layout
        k_teacher = int(batch.teacher_top_ids[0].shape[1])  # one K for every sample (check_fields)
        student_top_k = self.config.student_top_k  # None: the teacher's K
        k_student = int(k_teacher if student_top_k is None else student_top_k)
        device = logits.device
        index = layout.local_response_index.to(device)  # local rows that predict a response token
        _, student_ids_local = vocab_parallel_topk(logits, k_student, tp_group=self.groups.tp,
                                                   temperature=self.temperature)  # [T_local, Ks], no grad

        def local_rows(values, dtype):  # a per-response field -> this rank's response rows, concatenated
            return torch.cat(layout.slice_responses([torch.as_tensor(t) for t in values])).to(device, dtype)

        teacher_ids = local_rows(batch.teacher_top_ids, torch.long)             # [N, Kt]
        teacher_top = local_rows(batch.teacher_top_log_probs, torch.float32)    # [N, Kt]
        ids, support = union_topk_support(student_ids_local.index_select(0, index), teacher_ids)  # [N, Ks+Kt]

        # Teacher log-probs on the union: listed values, the sampled token, else the residual mass.
        # Unlisted ids: the largest value the teacher's answer allows (no single unlisted token can
        # exceed its smallest listed log-prob, nor the residual mass). Independent of TP and vocab.
        residual = torch.log((1.0 - teacher_top.double().exp().sum(-1)).clamp_min(1e-12)).float()
        fill = torch.minimum(teacher_top.amin(-1), residual)
        teacher_at_ids = fill.unsqueeze(-1).expand_as(ids).clone()
        if batch.teacher_log_probs is not None:
            sampled_ids = self._sampled_ids(batch, layout).to(device)
            sampled_lp = local_rows(batch.teacher_log_probs, torch.float32)
            is_sampled = ids == sampled_ids.unsqueeze(-1)
            teacher_at_ids = torch.where(is_sampled, sampled_lp.unsqueeze(-1).expand_as(ids), teacher_at_ids)
        listed = ids.unsqueeze(-1) == teacher_ids.unsqueeze(-2)             # [N, Ks+Kt, Kt]
        listed_values = torch.where(listed, teacher_top.unsqueeze(-2), torch.full_like(teacher_top.unsqueeze(-2), -torch.inf))
        teacher_at_ids = torch.where(listed.any(-1), listed_values.amax(-1), teacher_at_ids)

        ids_local = torch.zeros(layout.num_local_tokens, ids.shape[1], dtype=torch.long, device=device)
        ids_local[index] = ids
        student_local, _ = vocab_parallel_log_probs_at_ids(
            logits, ids_local, tp_group=self.groups.tp, temperature=self.temperature
        )  # [T_local, Ks+Kt], differentiable
        teacher_local = torch.zeros_like(student_local, dtype=torch.float32)
        teacher_local[index] = teacher_at_ids.to(teacher_local.dtype)
        support_local = torch.zeros_like(teacher_local)
        support_local[index] = support.to(support_local.dtype)
        # The view cuts the three alike (no communication: per-token only).
        return torch.stack([student_local, teacher_local.to(student_local.dtype), support_local.to(student_local.dtype)], -1)

    @staticmethod
    def _sampled_ids(batch, layout: PackedLayout) -> torch.Tensor:
        """The sampled (response) token ids of this rank's response rows, concatenated [N]."""
        responses = [seq[p:] for seq, p in zip(batch.tokens.split(layout.lengths), layout.prompt_lengths)]
        return torch.cat(layout.slice_responses(responses))
