# An estimator and a loss written against the padded plugin API ([B, T] tensors with masks,
# stacx.objectives.padded_api), as plugins of other frameworks are.
#   stacx train --custom-module examples/padded_plugins/my_algorithm.py --config examples/padded_plugins/my_algorithm.yaml ...
import torch
from stacx.objectives.padded_api import register_adv_estimator

@register_adv_estimator("my_advantage")
def compute_my_advantage(
    token_level_rewards: torch.Tensor,  # (batch, seq_len)
    response_mask: torch.Tensor,        # (batch, seq_len)
    gamma: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Compute custom advantages.

    Returns:
        advantages: (batch, seq_len)
        returns: (batch, seq_len)
    """
    # Sum rewards per sequence
    rewards = (token_level_rewards * response_mask).sum(dim=-1)

    # Normalize (simple baseline)
    advantages = rewards - rewards.mean()
    advantages = advantages.unsqueeze(-1) * response_mask

    returns = advantages.clone()
    return advantages, returns

from stacx.objectives.padded_api import (
    register_policy_loss,
    masked_mean,
    agg_loss,
)

@register_policy_loss("my_loss")
def compute_my_loss(
    old_log_prob: torch.Tensor,     # (batch, seq_len)
    log_prob: torch.Tensor,         # (batch, seq_len)
    advantages: torch.Tensor,       # (batch, seq_len)
    response_mask: torch.Tensor,    # (batch, seq_len)
    clip_ratio: float = 0.2,
    importance_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict]:
    """
    Compute custom policy loss.

    Returns:
        loss: Scalar loss tensor
        metrics: Dict of metrics to log
    """
    # Compute ratio
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-20, 20))

    # Clipped objective
    clipped = torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    loss = -torch.min(ratio * advantages, clipped * advantages)

    # Apply importance weights if provided
    if importance_weights is not None:
        loss = loss * importance_weights.unsqueeze(-1)

    # Aggregate
    loss = agg_loss(loss, response_mask, mode="token-mean")

    # Metrics
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "ratio_mean": masked_mean(ratio, response_mask).item(),
            "clip_frac": masked_mean(
                (ratio != clipped).float(), response_mask
            ).item(),
        }

    return loss, metrics
