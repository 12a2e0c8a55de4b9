"""Direct preference optimization: sigmoid (DPO) and IPO losses, one loss per pair.

For pair j with chosen response c and rejected response r, sequence log-probs are masked sums
log pi(y) = sum_t m_t log pi(y_t) (or masked means when `dpo_average_log_prob` is set), and

    h_j = (log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r))
    sigmoid: l_j = -(1 - eps) log sigmoid(beta h_j) - eps log sigmoid(-beta h_j)
    ipo:     l_j = (h_j - 1 / (2 beta))^2

beta = `dpo_beta` (0.1), eps = `label_smoothing` (0: plain DPO; > 0: conservative DPO).
The loss is per pair: aggregate it by summing and dividing by the global number of pairs.
Metrics are sums over pairs: `dpo_loss`, `chosen_reward` (beta (log pi(c) - log pi_ref(c))),
`rejected_reward`, `reward_margin`, `reward_accuracy` (1 where chosen_reward > rejected_reward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import register_loss
from stacx.objectives.validation import check_trajectory_lists

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_log_probs(log_prob, loss_masks, *, average: bool) -> torch.Tensor:
    """(num_sequences,) masked sums (or means) of per-token log-probs."""
    sums = [(lp * m.to(lp.dtype)).sum() for lp, m in zip(log_prob, loss_masks)]
    if average:
        sums = [s / m.to(s.dtype).sum().clamp_min(1.0) for s, m in zip(sums, loss_masks)]
    return torch.stack(sums)


def dpo_pair_losses(
    config: AlgorithmConfig,
    policy_chosen_log_prob,
    policy_rejected_log_prob,
    ref_chosen_log_prob,
    ref_rejected_log_prob,
    chosen_loss_masks,
    rejected_loss_masks,
    *,
    loss_type: str | None = None,
):
    """Per-pair losses (num_pairs,) and metrics; see the module docstring.

    Inputs are lists of (response_len,) tensors, one per pair; policy log-probs carry
    gradients. `loss_type` overrides config `dpo_loss_type` (`sigmoid` or `ipo`).
    """
    check_trajectory_lists(
        "policy_chosen_log_prob", policy_chosen_log_prob,
        ref_chosen_log_prob=ref_chosen_log_prob, chosen_loss_masks=chosen_loss_masks,
    )
    check_trajectory_lists(
        "policy_rejected_log_prob", policy_rejected_log_prob,
        ref_rejected_log_prob=ref_rejected_log_prob, rejected_loss_masks=rejected_loss_masks,
    )
    if len(policy_chosen_log_prob) != len(policy_rejected_log_prob):
        raise ValueError(
            f"policy_rejected_log_prob has {len(policy_rejected_log_prob)} pairs but "
            f"policy_chosen_log_prob has {len(policy_chosen_log_prob)}"
        )
    if not policy_chosen_log_prob:
        raise ValueError("policy_chosen_log_prob is empty: DPO needs at least one pair")
    loss_type = loss_type or config.dpo_loss_type
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo_loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    beta = float(config.dpo_beta)
    if beta <= 0:
        raise ValueError(f"dpo_beta must be > 0, got {beta}")
    smoothing = float(config.label_smoothing)
    if not 0.0 <= smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {smoothing}")
    average = bool(config.dpo_average_log_prob)

    detached_ref = lambda xs: [x.detach() for x in xs]  # noqa: E731 - the reference is frozen
    chosen = sequence_log_probs(policy_chosen_log_prob, chosen_loss_masks, average=average)
    rejected = sequence_log_probs(policy_rejected_log_prob, rejected_loss_masks, average=average)
    ref_chosen = sequence_log_probs(detached_ref(ref_chosen_log_prob), chosen_loss_masks, average=average)
    ref_rejected = sequence_log_probs(detached_ref(ref_rejected_log_prob), rejected_loss_masks, average=average)
    chosen_logratio = chosen - ref_chosen
    rejected_logratio = rejected - ref_rejected
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -(1.0 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)).square()
    chosen_reward = beta * chosen_logratio.detach()
    rejected_reward = beta * rejected_logratio.detach()
    metrics = {
        "dpo_loss": losses.detach().sum(),
        "chosen_reward": chosen_reward.sum(),
        "rejected_reward": rejected_reward.sum(),
        "reward_margin": (chosen_reward - rejected_reward).sum(),
        "reward_accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype).sum(),
    }
    return losses, metrics


@register_loss("dpo")
def dpo(config: AlgorithmConfig, *args, **kwargs):
    """DPO with `dpo_loss_type` read from the config (see `dpo_pair_losses`)."""
    return dpo_pair_losses(config, *args, **kwargs)


@register_loss("dpo_sigmoid")
def dpo_sigmoid(config: AlgorithmConfig, *args, **kwargs):
    """DPO, sigmoid (Bradley-Terry) loss with optional label smoothing."""
    return dpo_pair_losses(config, *args, loss_type="sigmoid", **kwargs)


@register_loss("dpo_ipo")
def dpo_ipo(config: AlgorithmConfig, *args, **kwargs):
    """IPO: squared loss pulling h towards 1 / (2 beta)."""
    return dpo_pair_losses(config, *args, loss_type="ipo", **kwargs)
