"""KL estimators (k1, k2, k3 / low_var_kl), the KL loss term and the entropy bonus.

With samples drawn from the policy pi and d = log pi(y) - log pi_ref(y) per token:

    k1 = d                           unbiased for KL(pi || pi_ref), high variance, can be < 0
    k2 = d^2 / 2                     biased, low variance, >= 0
    k3 = exp(-d) - 1 + d             unbiased, >= 0 ("low_var_kl"); d clamped to [-20, 20]
                                     and k3 clamped to [-10, 10] so one outlier cannot blow up

Estimators are elementwise on tensors of any equal shape; use them on concatenated
per-trajectory tensors or per trajectory.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import get_kl_estimator, register_kl_estimator
from stacx.objectives.validation import check_trajectory_lists

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _check_shapes(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> None:
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"ref_log_prob shape {tuple(ref_log_prob.shape)} != log_prob shape {tuple(log_prob.shape)}"
        )


@register_kl_estimator("k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref."""
    _check_shapes(log_prob, ref_log_prob)
    return log_prob - ref_log_prob


@register_kl_estimator("k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2."""
    _check_shapes(log_prob, ref_log_prob)
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3", aliases=("low_var_kl",))
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-d) - 1 + d with d = clamp(log pi - log pi_ref, +-20), result clamped to +-10."""
    _check_shapes(log_prob, ref_log_prob)
    d = (log_prob - ref_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(-d) - 1.0 + d).clamp(-K3_CLAMP, K3_CLAMP)


def kl_per_trajectory(
    log_prob: Sequence[torch.Tensor], ref_log_prob: Sequence[torch.Tensor], estimator: str = "low_var_kl"
) -> list[torch.Tensor]:
    """Apply a registered estimator trajectory by trajectory: list of (response_len_i,)."""
    check_trajectory_lists("log_prob", log_prob, ref_log_prob=ref_log_prob)
    fn = get_kl_estimator(estimator)
    return [fn(lp, ref) for lp, ref in zip(log_prob, ref_log_prob)]


def add_kl_and_entropy_terms(
    config: AlgorithmConfig,
    per_token_loss: Sequence[torch.Tensor],
    log_prob: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    ref_log_prob: Sequence[torch.Tensor] | None = None,
    entropy: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Add the KL loss term and the entropy bonus to a policy loss, per token.

        loss_t = policy_loss_t + kl_loss_coef * KL_est(log pi_t, log pi_ref_t) - entropy_coef * H_t

    config: `use_kl_loss` (default False; True needs ref_log_prob), `kl_loss_coef` (0.001),
    `kl_loss_type` (estimator name, default `low_var_kl`), `entropy_coef` (0; > 0 needs
    entropy). Metrics (loss-mask-weighted sums): `kl_loss` when the KL term is on,
    `entropy` when entropy is given.
    """
    check_trajectory_lists(
        "log_prob", log_prob, per_token_loss=per_token_loss, loss_masks=loss_masks,
        ref_log_prob=ref_log_prob, entropy=entropy,
    )
    total = list(per_token_loss)
    metrics: dict[str, torch.Tensor] = {}
    if config.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("use_kl_loss is set but ref_log_prob was not provided")
        coef = float(config.kl_loss_coef)
        kl = kl_per_trajectory(log_prob, ref_log_prob, config.kl_loss_type)
        total = [loss + coef * k for loss, k in zip(total, kl)]
        metrics["kl_loss"] = sum((k.detach() * m).sum() for k, m in zip(kl, loss_masks))
    entropy_coef = float(config.entropy_coef)
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef is {entropy_coef} but entropy was not provided")
    if entropy is not None:
        if entropy_coef != 0.0:
            total = [loss + entropy_bonus(h, entropy_coef) for loss, h in zip(total, entropy)]
        metrics["entropy"] = sum((h.detach() * m).sum() for h, m in zip(entropy, loss_masks))
    return total, metrics


def entropy_bonus(entropy: torch.Tensor, entropy_coef: float) -> torch.Tensor:
    """Per-token loss term -entropy_coef * H (maximizing entropy lowers the loss)."""
    return -entropy_coef * entropy
