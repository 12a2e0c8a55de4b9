"""Off-policy protection: importance weights and masks for the train/rollout mismatch.

The framework calls these before aggregation and applies the result to the per-token loss:
`loss_t * weight_t * mask_t`. Signature: `fn(config, train_log_prob, rollout_log_prob,
loss_masks, **kwargs) -> OffPolicyCorrection`, lists of (response_len_i,) tensors.
`train_log_prob` is the trainer's log-prob of the sampled token (pi_old recomputed by the
trainer, or the current pi_theta for OPSM/M2PO), `rollout_log_prob` the inference engine's.
With delta_t = train_log_prob_t - rollout_log_prob_t (clamped to +-20) and n_i = sum_t m_it:

| name           | effect                                                                       |
| -------------- | ---------------------------------------------------------------------------- |
| `token_tis`    | w_t = min(exp(delta_t), C)                                                   |
| `sequence_tis` | w_it = min(exp(sum_t m_it delta_t), C)                                       |
| `token_mis`    | m_t = 0 where exp(delta_t) is outside [lo, hi]; kept tokens get w_t = exp(delta_t) |
| `sequence_mis` | whole sequence masked where exp(sum_t m_it delta_t) is outside [lo, hi]; else w = that ratio |
| `opsm`         | sequence masked where its advantage is < 0 and -sum_t m_it delta_t / n_i > opsm_delta |
| `m2po`         | mask the fewest tokens of largest delta_t^2 so that the mean delta^2 of the rest <= m2po_threshold |

config: `tis_threshold` C (2.0), `mis_lower` lo (0.5), `mis_upper` hi (2.0), `opsm_delta`
(1e-4), `m2po_threshold` (0.04). Weights and masks carry no gradient.

Every correction also reports the mismatch between trainer and engine (loss-mask-weighted sums
over the incoming masks, for the framework to divide by the global token count):
`mismatch_k1` (sum of rollout - train, an estimate of KL(rollout || train) per token),
`mismatch_k3` (k3 of the same), `mismatch_abs_log_ratio` (|delta|), `mismatch_ratio` (exp(delta)),
plus `<name>_masked` (tokens the correction masked) or `<name>_clipped` (weights truncated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import get_off_policy_correction, register_off_policy_correction
from stacx.objectives.validation import check_trajectory_lists, split_like

LOG_RATIO_CLAMP = 20.0


@dataclass
class OffPolicyCorrection:
    """The result of an off-policy correction (all lists of (response_len_i,) tensors)."""

    loss_masks: list[torch.Tensor]
    """The masks after the correction (a subset of the incoming masks)."""
    weights: list[torch.Tensor] | None = None
    """Per-token importance weights to multiply into the loss, or None (all ones)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Loss-mask-weighted sums (0-dim tensors)."""


def _prepare(train_log_prob, rollout_log_prob, loss_masks):
    lengths = check_trajectory_lists(
        "train_log_prob", train_log_prob, rollout_log_prob=rollout_log_prob, loss_masks=loss_masks
    )
    train = torch.cat(list(train_log_prob)).detach().to(torch.float64) if lengths else torch.zeros(0, dtype=torch.float64)
    rollout = torch.cat(list(rollout_log_prob)).detach().to(torch.float64) if lengths else torch.zeros(0, dtype=torch.float64)
    mask = torch.cat(list(loss_masks)).detach().to(torch.float64) if lengths else torch.zeros(0, dtype=torch.float64)
    delta = (train - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return lengths, delta, mask


def mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks) -> dict[str, torch.Tensor]:
    """Train/rollout log-prob mismatch as loss-mask-weighted sums (see the module docstring)."""
    _, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    return {
        "mismatch_k1": (-delta * mask).sum(),
        "mismatch_k3": ((torch.exp(delta) - 1.0 - delta) * mask).sum(),
        "mismatch_abs_log_ratio": (delta.abs() * mask).sum(),
        "mismatch_ratio": (torch.exp(delta) * mask).sum(),
    }


def _sequence_sums(values: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-sequence masked sums broadcast back to tokens: (sum(lengths),)."""
    parts = [(v * m).sum().expand(v.shape[0]) for v, m in zip(split_like(values, lengths), split_like(mask, lengths))]
    return torch.cat(parts) if parts else values.new_zeros(0)


def _result(lengths, mask, weights, metrics, like) -> OffPolicyCorrection:
    dtype = like[0].dtype if like else torch.float32
    return OffPolicyCorrection(
        loss_masks=[m.to(dtype) for m in split_like(mask, lengths)],
        weights=None if weights is None else [w.to(torch.float32) for w in split_like(weights, lengths)],
        metrics=metrics,
    )


def _bounds(config: AlgorithmConfig) -> tuple[float, float]:
    lower = float(config.mis_lower)
    upper = float(config.mis_upper)
    if not 0.0 <= lower < upper:
        raise ValueError(f"need 0 <= mis_lower < mis_upper, got mis_lower={lower}, mis_upper={upper}")
    return lower, upper


def _threshold(config: AlgorithmConfig) -> float:
    threshold = float(config.tis_threshold)
    if threshold <= 0:
        raise ValueError(f"tis_threshold must be > 0, got {threshold}")
    return threshold


@register_off_policy_correction("token_tis", token_local=True)
def token_tis(config: AlgorithmConfig, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection:
    """Token-level truncated IS: w_t = min(exp(delta_t), tis_threshold)."""
    lengths, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    ratio = torch.exp(delta)
    weights = ratio.clamp(max=_threshold(config))
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    metrics["token_tis_clipped"] = ((ratio > weights).to(torch.float64) * mask).sum()
    return _result(lengths, mask, weights, metrics, loss_masks)


@register_off_policy_correction("sequence_tis")
def sequence_tis(config: AlgorithmConfig, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection:
    """Sequence-level truncated IS: w_i = min(exp(sum_t m_it delta_t), tis_threshold) on every token."""
    lengths, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    ratio = torch.exp(_sequence_sums(delta, mask, lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = ratio.clamp(max=_threshold(config))
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    metrics["sequence_tis_clipped"] = ((ratio > weights).to(torch.float64) * mask).sum()
    return _result(lengths, mask, weights, metrics, loss_masks)


@register_off_policy_correction("token_mis", token_local=True)
def token_mis(config: AlgorithmConfig, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection:
    """Token-level masked IS: drop tokens whose ratio is outside [mis_lower, mis_upper]."""
    lengths, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    lower, upper = _bounds(config)
    ratio = torch.exp(delta)
    keep = ((ratio >= lower) & (ratio <= upper)).to(torch.float64)
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    metrics["token_mis_masked"] = ((1.0 - keep) * mask).sum()
    return _result(lengths, mask * keep, ratio * keep, metrics, loss_masks)


@register_off_policy_correction("sequence_mis")
def sequence_mis(config: AlgorithmConfig, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection:
    """Sequence-level masked IS: drop sequences whose ratio exp(sum_t m delta) is outside bounds."""
    lengths, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    lower, upper = _bounds(config)
    ratio = torch.exp(_sequence_sums(delta, mask, lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    keep = ((ratio >= lower) & (ratio <= upper)).to(torch.float64)
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    metrics["sequence_mis_masked"] = ((1.0 - keep) * mask).sum()
    return _result(lengths, mask * keep, ratio * keep, metrics, loss_masks)


@register_off_policy_correction("opsm", uses_current_policy=True)
def opsm(config: AlgorithmConfig, train_log_prob, rollout_log_prob, loss_masks, *, advantages,
         **kwargs) -> OffPolicyCorrection:
    """Off-policy sequence masking (DeepSeek-V3.2).

    Sequence i is masked when sum_t m_it A_it < 0 (a negative-advantage sample) and its mean
    per-token KL estimate (1/n_i) sum_t m_it (log pi_rollout - log pi_theta) > opsm_delta.
    `train_log_prob` is the current policy's log-prob (detached); `advantages` is required.
    """
    lengths, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    check_trajectory_lists("train_log_prob", train_log_prob, advantages=advantages)
    opsm_delta = float(config.opsm_delta)
    adv = torch.cat(list(advantages)).detach().to(torch.float64) if lengths else delta.new_zeros(0)
    tokens = _sequence_sums(torch.ones_like(mask), mask, lengths).clamp_min(1.0)
    mean_kl = _sequence_sums(-delta, mask, lengths) / tokens
    negative = _sequence_sums(adv, mask, lengths) < 0
    keep = (~(negative & (mean_kl > opsm_delta))).to(torch.float64)
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    metrics["opsm_masked"] = ((1.0 - keep) * mask).sum()
    return _result(lengths, mask * keep, None, metrics, loss_masks)


def m2po_keep_mask(squared_log_ratio: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep mask (same shape, bool) dropping the fewest largest values so the kept mean <= threshold.

    Sort descending; dropping the k largest leaves mean_k = (total - top_k) / (n - k), which
    only decreases with k; pick the smallest k with mean_k <= threshold.
    """
    n = squared_log_ratio.numel()
    keep = torch.ones(n, dtype=torch.bool)
    if n == 0 or squared_log_ratio.mean() <= threshold:
        return keep
    values, order = torch.sort(squared_log_ratio, descending=True)
    kept_sums = values.sum() - torch.cumsum(values, 0)  # after dropping the first k+1
    kept_counts = torch.arange(n - 1, -1, -1, dtype=values.dtype)
    kept_mean = torch.where(kept_counts > 0, kept_sums / kept_counts.clamp_min(1), torch.zeros_like(kept_sums))
    num_drop = int(torch.nonzero(kept_mean <= threshold)[0]) + 1
    keep[order[:num_drop]] = False
    return keep


@register_off_policy_correction("m2po", uses_current_policy=True)
def m2po(config: AlgorithmConfig, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection:
    """M2PO: bound the second moment of the log-ratio by masking its largest tokens.

    Over the loss-masked tokens of all trajectories given, M2 = mean_t delta_t^2. If
    M2 > m2po_threshold, mask the fewest tokens with the largest delta_t^2 such that the M2 of
    the remaining tokens is <= m2po_threshold. Applied to the batch it is given (call it on the
    whole step's batch for a split-independent result).
    """
    lengths, delta, mask = _prepare(train_log_prob, rollout_log_prob, loss_masks)
    threshold = float(config.m2po_threshold)
    if threshold < 0:
        raise ValueError(f"m2po_threshold must be >= 0, got {threshold}")
    active = mask > 0
    keep = torch.ones_like(mask)
    keep_active = m2po_keep_mask(delta[active].square(), threshold)
    keep[active] = keep_active.to(torch.float64)
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    metrics["m2po_masked"] = ((1.0 - keep) * mask).sum()
    return _result(lengths, mask * keep, None, metrics, loss_masks)


def apply_off_policy_corrections(
    config: AlgorithmConfig,
    names: Sequence[str],
    train_log_prob: Sequence[torch.Tensor],
    rollout_log_prob: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    **kwargs,
) -> OffPolicyCorrection:
    """Apply registered corrections in order: masks multiply, weights multiply, metrics merge
    (the mismatch metrics, identical for every correction, are reported once)."""
    masks = [m for m in loss_masks]
    weights: list[torch.Tensor] | None = None
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, loss_masks)
    for name in names:
        result = get_off_policy_correction(name)(config, train_log_prob, rollout_log_prob, masks, **kwargs)
        masks = result.loss_masks
        if result.weights is not None:
            weights = result.weights if weights is None else [a * b for a, b in zip(weights, result.weights)]
        metrics.update({k: v for k, v in result.metrics.items() if not k.startswith("mismatch_")})
    return OffPolicyCorrection(loss_masks=masks, weights=weights, metrics=metrics)
