"""Policy losses: ppo_clip, gspo, cispo, vanilla_pg, reinforce.

Signature (all): `fn(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs)
-> (per_token_loss, metrics)`. Inputs are lists of (response_len_i,) tensors; `log_prob`
carries gradients. The kernel never aggregates and never applies masks or importance weights
to the returned loss (the framework does); masks are used only for sequence-level statistics
(GSPO) and for metrics. Metrics are detached loss-mask-weighted SUMS (0-dim tensors); the
framework all-reduces them and divides by the global token count.

With rho_t = exp(clamp(log pi_t - log pi_old_t, +-20)) and advantage A_t. Clip bounds come from
config `clip_ratio_low` / `clip_ratio_high` (each defaults to `clip_ratio`, default 0.2).
"""

from __future__ import annotations

import torch

from stacx.objectives.aggregation import sum_of_sample_mean  # noqa: F401  (where guide 003 imports it from)
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import register_policy_loss
from stacx.objectives.validation import check_trajectory_lists, split_like

LOG_RATIO_CLAMP = 20.0


def _clip_bounds(config: AlgorithmConfig) -> tuple[float, float]:
    # AlgorithmConfig fills an unset clip_ratio_low / _high with clip_ratio.
    low, high = float(config.clip_ratio_low), float(config.clip_ratio_high)
    if low < 0 or high < 0:
        raise ValueError(f"clip_ratio_low ({low}) and clip_ratio_high ({high}) must be >= 0")
    return low, high


def _flatten(old_log_prob, log_prob, advantages, loss_masks):
    lengths = check_trajectory_lists(
        "log_prob", log_prob, old_log_prob=old_log_prob, advantages=advantages, loss_masks=loss_masks
    )
    if not lengths:
        raise ValueError("log_prob is empty: a policy loss needs at least one trajectory")
    cat = torch.cat
    return (
        lengths,
        cat(list(old_log_prob)).detach(),
        cat(list(log_prob)),
        cat(list(advantages)).detach(),
        cat(list(loss_masks)).detach(),
    )


def _msum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values.detach() * mask.to(values.dtype)).sum()


@register_policy_loss("ppo_clip", aliases=("ppo",), token_local=True)
def ppo_clip(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    """PPO clipped surrogate with asymmetric clip and dual-clip.

        l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - clip_ratio_low, 1 + clip_ratio_high))
        if A_t < 0 and clip_ratio_c is set:  l_t = min(l_t, -A_t * clip_ratio_c)

    config: `clip_ratio` (0.2), `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c` (dual clip
    bound, must be > 1; None, the default, turns it off; verl's dual-clip value is 3.0).
    Metrics: `pg_loss`, `pg_clipfrac` (tokens where the clipped branch is active),
    `pg_clipfrac_lower` (dual clip active), `ppo_kl` (log pi_old - log pi).
    """
    lengths, old, new, adv, mask = _flatten(old_log_prob, log_prob, advantages, loss_masks)
    low, high = _clip_bounds(config)
    clip_c = config.clip_ratio_c
    log_ratio = (new - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": _msum((clipped > unclipped).to(new.dtype), mask)}
    if clip_c is not None:
        clip_c = float(clip_c)
        if clip_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_c}")
        dual_bound = -adv * clip_c
        dual_active = (adv < 0) & (dual_bound < loss)
        loss = torch.where(adv < 0, torch.minimum(loss, dual_bound), loss)
        metrics["pg_clipfrac_lower"] = _msum(dual_active.to(new.dtype), mask)
    metrics["pg_loss"] = _msum(loss, mask)
    metrics["ppo_kl"] = _msum(old - new, mask)
    return split_like(loss, lengths), metrics


@register_policy_loss("gspo")
def gspo(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    """GSPO: a sequence-level ratio with a token-level gradient path.

        s_i  = exp( sum_t m_it (log pi_it - log pi_old_it) / n_i )     (n_i = sum_t m_it)
        s_it = sg(s_i) * pi_it / sg(pi_it)        (value s_i, d s_it / d log pi_it = s_i)
        l_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    log_prob must be the whole trajectory (the framework gathers CP shards first). The GSPO
    paper uses tiny bounds (clip_ratio_low 3e-4, clip_ratio_high 4e-4): set them in the config.
    Metrics: `pg_loss`, `pg_clipfrac`, `ppo_kl` (token-level log pi_old - log pi).
    """
    lengths, old, new, adv, mask = _flatten(old_log_prob, log_prob, advantages, loss_masks)
    low, high = _clip_bounds(config)
    token_log_ratio = new - old
    seq_log_ratio = []
    for lr_i, m_i in zip(split_like(token_log_ratio.detach(), lengths), split_like(mask, lengths)):
        m_i = m_i.to(lr_i.dtype)
        seq_log_ratio.append(((lr_i * m_i).sum() / m_i.sum().clamp_min(1.0)).expand(lr_i.shape[0]))
    seq_log_ratio = torch.cat(seq_log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(seq_log_ratio + new - new.detach())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_loss": _msum(loss, mask),
        "pg_clipfrac": _msum((clipped > unclipped).to(new.dtype), mask),
        "ppo_kl": _msum(old - new, mask),
    }
    return split_like(loss, lengths), metrics


@register_policy_loss("cispo", token_local=True)
def cispo(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    """CISPO: clip the importance weight, not the update; every token keeps a gradient.

        l_t = -sg(clip(rho_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * log pi_t

    A `clip_ratio_low` >= 1 removes the lower bound (MiniMax-M1 clips only from above).
    Metrics: `pg_loss`, `pg_clipfrac` (tokens whose weight was clipped), `ppo_kl`.
    """
    lengths, old, new, adv, mask = _flatten(old_log_prob, log_prob, advantages, loss_masks)
    low, high = _clip_bounds(config)
    ratio = torch.exp((new.detach() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(max(1.0 - low, 0.0), 1.0 + high)
    loss = -weight * adv * new
    metrics = {
        "pg_loss": _msum(loss, mask),
        "pg_clipfrac": _msum((weight != ratio).to(new.dtype), mask),
        "ppo_kl": _msum(old - new, mask),
    }
    return split_like(loss, lengths), metrics


@register_policy_loss("vanilla_pg", token_local=True)
def vanilla_pg(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    """Importance-weighted policy gradient without clipping: l_t = -A_t rho_t.

    Metrics: `pg_loss`, `ppo_kl`.
    """
    lengths, old, new, adv, mask = _flatten(old_log_prob, log_prob, advantages, loss_masks)
    loss = -adv * torch.exp((new - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    metrics = {"pg_loss": _msum(loss, mask), "ppo_kl": _msum(old - new, mask)}
    return split_like(loss, lengths), metrics


@register_policy_loss("reinforce", token_local=True)
def reinforce(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    """REINFORCE, no ratio: l_t = -A_t log pi_t (on-policy; `old_log_prob` only feeds metrics).

    Metrics: `pg_loss`, `ppo_kl`.
    """
    lengths, old, new, adv, mask = _flatten(old_log_prob, log_prob, advantages, loss_masks)
    loss = -adv * new
    metrics = {"pg_loss": _msum(loss, mask), "ppo_kl": _msum(old - new, mask)}
    return split_like(loss, lengths), metrics

