"""Distillation losses against a teacher's log-probs (on-policy distillation and DAgger).

Notation per response token t: s_t = log pi_student(y_t) (with gradients), u_t = log
pi_teacher(y_t) for the same sampled token, and r_t = clamp(u_t - s_t, +-20).

- `distill_reverse_kl_k3`: the single-sample K3 estimate of KL(student || teacher) on the
  sampled token, l_t = exp(r_t) - 1 - r_t  (>= 0, 0 where the models agree).
- `distill_topk_reverse_kl`: exact reverse KL over a support (the union of the student's and
  the teacher's top-K token ids), both distributions renormalized on it.
- `distill_mixed`: DAgger-style per-token dispatch. A teacher log-prob of exactly +1.0 (a
  sentinel; real log-probs are <= 0) marks a token the teacher executed: it gets cross-entropy
  -s_t. Every other token was executed by the student and gets K3.
"""

from __future__ import annotations

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import register_loss
from stacx.objectives.validation import check_trajectory_lists, split_like

LOG_RATIO_CLAMP = 20.0
TEACHER_EXECUTED_SENTINEL = 1.0
"""Written into teacher_log_probs where the teacher produced the token (real log-probs are <= 0);
the rollout writes it (stacx.rollout.manager), these kernels read it."""
_POSITIVE_LOG_PROB_TOLERANCE = 1e-4


def k3_reverse_kl(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """Elementwise exp(r) - 1 - r with r = clamp(teacher - student, +-20)."""
    r = (teacher_log_prob - student_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(r) - 1.0 - r


def _flatten(log_prob, teacher_log_prob, loss_masks):
    lengths = check_trajectory_lists("log_prob", log_prob, teacher_log_prob=teacher_log_prob, loss_masks=loss_masks)
    if not lengths:
        raise ValueError("log_prob is empty: a distillation loss needs at least one trajectory")
    student = torch.cat(list(log_prob))
    teacher = torch.cat(list(teacher_log_prob)).detach().to(student.dtype)
    mask = torch.cat(list(loss_masks)).detach().to(student.dtype)
    return lengths, student, teacher, mask


@register_loss("distill_reverse_kl_k3")
def distill_reverse_kl_k3(config: AlgorithmConfig, log_prob, teacher_log_prob, loss_masks):
    """Per-token K3 reverse KL on the sampled token (see the module docstring).

    log_prob, teacher_log_prob, loss_masks: lists of (response_len_i,). teacher_log_prob
    must hold real log-probs (<= 0). Metrics: `k3_mean` (mask-weighted sum of K3),
    `log_ratio` (sum of s_t - u_t, the k1 estimate of the same KL).
    """
    lengths, student, teacher, mask = _flatten(log_prob, teacher_log_prob, loss_masks)
    _check_real_log_probs(teacher, lengths, allow_sentinel=False)
    loss = k3_reverse_kl(student, teacher)
    metrics = {
        "k3_mean": (loss.detach() * mask).sum(),
        "log_ratio": ((student.detach() - teacher) * mask).sum(),
    }
    return split_like(loss, lengths), metrics


def _check_real_log_probs(teacher: torch.Tensor, lengths, *, allow_sentinel: bool) -> torch.Tensor:
    """Raise on teacher log-probs > 0 (other than the sentinel); returns the sentinel mask."""
    sentinel = teacher == TEACHER_EXECUTED_SENTINEL if allow_sentinel else torch.zeros_like(teacher, dtype=torch.bool)
    invalid = (teacher > _POSITIVE_LOG_PROB_TOLERANCE) & ~sentinel
    invalid = invalid | torch.isnan(teacher)
    if invalid.any():
        for index, bad in enumerate(split_like(invalid, lengths)):
            if bad.any():
                position = int(torch.nonzero(bad)[0])
                hint = " (only the +1.0 sentinel may be positive)" if allow_sentinel else ""
                raise ValueError(
                    f"teacher_log_prob[{index}][{position}] = {float(split_like(teacher, lengths)[index][position])} "
                    f"is not a log-prob{hint}"
                )
    return sentinel


@register_loss("distill_mixed")
def distill_mixed(config: AlgorithmConfig, log_prob, teacher_log_prob, loss_masks):
    """Mixed per-token dispatch: cross-entropy on teacher-executed tokens, K3 on student ones.

        l_t = -s_t                       if u_t == +1.0 (teacher executed the token)
        l_t = exp(r_t) - 1 - r_t         otherwise (student executed it; r_t = u_t - s_t)

    All teacher tokens: pure CE (SFT on the teacher's actions); all student tokens: pure K3.
    Metrics (mask-weighted sums, divided by the global token count downstream):
    `ce_mean` (sum of CE over teacher tokens), `k3_mean` (sum of K3 over student tokens),
    `teacher_action_frac` (number of teacher tokens). After the division, ce_mean / 
    teacher_action_frac is the mean CE per teacher token.
    """
    lengths, student, teacher, mask = _flatten(log_prob, teacher_log_prob, loss_masks)
    is_teacher = _check_real_log_probs(teacher, lengths, allow_sentinel=True)
    # The sentinel is not a log-prob: keep it out of the K3 branch (its gradient would be finite
    # but meaningless, and exp(1 - s) could overflow for very negative s).
    safe_teacher = torch.where(is_teacher, student.detach(), teacher)
    k3 = k3_reverse_kl(student, safe_teacher)
    ce = -student
    loss = torch.where(is_teacher, ce, k3)
    teacher_mask = is_teacher.to(student.dtype) * mask
    student_mask = (~is_teacher).to(student.dtype) * mask
    metrics = {
        "ce_mean": (ce.detach() * teacher_mask).sum(),
        "k3_mean": (k3.detach() * student_mask).sum(),
        "teacher_action_frac": teacher_mask.sum(),
    }
    return split_like(loss, lengths), metrics


def union_topk_support(student_topk_ids: torch.Tensor, teacher_topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of two top-K id sets per token.

    student_topk_ids (T, Ks), teacher_topk_ids (T, Kt) -> ids (T, Ks + Kt), support_mask
    (T, Ks + Kt) bool. Teacher ids already among the student's are masked out (their id slot
    repeats the student's first id so gathers stay in range).
    """
    if student_topk_ids.dim() != 2 or teacher_topk_ids.dim() != 2 or student_topk_ids.shape[0] != teacher_topk_ids.shape[0]:
        raise ValueError(
            f"student_topk_ids {tuple(student_topk_ids.shape)} and teacher_topk_ids "
            f"{tuple(teacher_topk_ids.shape)} must be (tokens, K) with the same number of tokens"
        )
    duplicate = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
    teacher_ids = torch.where(duplicate, student_topk_ids[:, :1].expand_as(teacher_topk_ids), teacher_topk_ids)
    ids = torch.cat([student_topk_ids, teacher_ids], dim=-1)
    mask = torch.cat([torch.ones_like(student_topk_ids, dtype=torch.bool), ~duplicate], dim=-1)
    return ids, mask


@register_loss("distill_topk_reverse_kl")
def distill_topk_reverse_kl(config: AlgorithmConfig, student_log_probs, teacher_log_probs, support_masks, loss_masks):
    """Reverse KL over a per-token support S_t (e.g. `union_topk_support`), per token.

        q_tk = softmax_{k in S_t}(s_tk),  p_tk = softmax_{k in S_t}(u_tk)
        l_t  = sum_{k in S_t} q_tk (log q_tk - log p_tk)

    student_log_probs (with gradients), teacher_log_probs, support_masks: lists of (T_i, K)
    tensors holding the full-vocabulary log-probs at the support ids; loss_masks: list of
    (T_i,). With config `distill_topk_renormalize: false` the truncated sum
    sum_k exp(s_tk) (s_tk - u_tk) is used instead (no renormalization).
    Metrics: `topk_reverse_kl` (mask-weighted sum of l_t), `student_support_mass`
    (sum of the student's probability mass inside the support).
    """
    if not (len(student_log_probs) == len(teacher_log_probs) == len(support_masks) == len(loss_masks)):
        raise ValueError(
            "student_log_probs, teacher_log_probs, support_masks and loss_masks must have the same number of "
            f"trajectories, got {len(student_log_probs)}, {len(teacher_log_probs)}, {len(support_masks)}, {len(loss_masks)}"
        )
    if not student_log_probs:
        raise ValueError("student_log_probs is empty: a distillation loss needs at least one trajectory")
    for index, (s, u, sm, m) in enumerate(zip(student_log_probs, teacher_log_probs, support_masks, loss_masks)):
        if s.dim() != 2:
            raise ValueError(f"student_log_probs[{index}] must be (tokens, K), got {tuple(s.shape)}")
        for name, other in (("teacher_log_probs", u), ("support_masks", sm)):
            if other.shape != s.shape:
                raise ValueError(f"{name}[{index}] has shape {tuple(other.shape)} but student_log_probs[{index}] has {tuple(s.shape)}")
        if m.dim() != 1 or m.shape[0] != s.shape[0]:
            raise ValueError(f"loss_masks[{index}] has shape {tuple(m.shape)} but student_log_probs[{index}] has {s.shape[0]} tokens")
    renormalize = bool(config.distill_topk_renormalize)
    lengths = [s.shape[0] for s in student_log_probs]
    s = torch.cat(list(student_log_probs))
    u = torch.cat(list(teacher_log_probs)).detach().to(s.dtype)
    support = torch.cat(list(support_masks)).to(torch.bool)
    mask = torch.cat(list(loss_masks)).detach().to(s.dtype)
    very_negative = torch.finfo(s.dtype).min / 4
    s_masked = s.masked_fill(~support, very_negative)
    u_masked = u.masked_fill(~support, very_negative)
    if renormalize:
        log_q = torch.log_softmax(s_masked, dim=-1)
        log_p = torch.log_softmax(u_masked, dim=-1)
    else:
        log_q, log_p = s_masked, u_masked
    terms = torch.where(support, log_q.exp() * (log_q - log_p), torch.zeros_like(s))
    loss = terms.sum(-1)
    metrics = {
        "topk_reverse_kl": (loss.detach() * mask).sum(),
        "student_support_mass": ((s.detach().exp() * support).sum(-1) * mask).sum(),
    }
    return split_like(loss, lengths), metrics
