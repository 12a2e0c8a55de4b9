"""Clipped value loss for the critic."""

from __future__ import annotations

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import register_loss
from stacx.objectives.validation import check_trajectory_lists, split_like


@register_loss("value_clipped")
def value_clipped(config: AlgorithmConfig, values, old_values, returns, loss_masks):
    """PPO clipped value loss, per token.

        V_clip_t = V_old_t + clip(V_t - V_old_t, -value_clip, +value_clip)
        l_t      = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)

    values (with gradients), old_values (the critic at rollout), returns (targets R, e.g.
    `gae_returns`), loss_masks: lists of (response_len_i,). config: `value_clip` (declared default None; None
    disables clipping). Metrics (mask-weighted sums): `vf_loss`, `vf_clipfrac` (tokens where
    the clipped term is larger), `vf_value` (V_t).
    """
    lengths = check_trajectory_lists(
        "values", values, old_values=old_values, returns=returns, loss_masks=loss_masks
    )
    v = torch.cat(list(values))
    old = torch.cat(list(old_values)).detach()
    target = torch.cat(list(returns)).detach()
    mask = torch.cat(list(loss_masks)).detach().to(v.dtype)
    unclipped = (v - target).square()
    clip = config.value_clip  # None (the declared default): unclipped
    if clip is None:
        clipped = unclipped
    else:
        clip = float(clip)
        if clip < 0:
            raise ValueError(f"value_clip must be >= 0, got {clip}")
        clipped = (old + (v - old).clamp(-clip, clip) - target).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {
        "vf_loss": (loss.detach() * mask).sum(),
        "vf_clipfrac": ((clipped > unclipped).to(v.dtype) * mask).sum(),
        "vf_value": (v.detach() * mask).sum(),
    }
    return split_like(loss, lengths), metrics
