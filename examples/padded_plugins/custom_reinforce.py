# REINFORCE with a baseline as a padded plugin (stacx.objectives.padded_api). The plugin's entropy bonus is its own:
# Stacx adds none on top, and its default entropy_coef=0.01 holds unless the run sets entropy_coef.
#   stacx train --custom-module examples/padded_plugins/custom_reinforce.py \
#       --advantage-estimator reinforce_baseline --policy-loss reinforce_pg ...
import torch
from stacx.objectives.padded_api import (
    register_adv_estimator,
    register_policy_loss,
    masked_mean,
)

@register_adv_estimator("reinforce_baseline")
def reinforce_with_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    baseline: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with moving average baseline."""
    rewards = (token_level_rewards * response_mask).sum(dim=-1)
    advantages = rewards - baseline
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()

@register_policy_loss("reinforce_pg")
def reinforce_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    entropy_coef: float = 0.01,
    **kwargs,
) -> tuple[torch.Tensor, dict]:
    """Vanilla REINFORCE with entropy bonus."""
    # Policy gradient
    pg_loss = -log_prob * advantages.detach()

    # Entropy bonus
    entropy = -log_prob

    # Combined
    loss = masked_mean(pg_loss - entropy_coef * entropy, response_mask)

    metrics = {
        "pg_loss": masked_mean(pg_loss, response_mask).item(),
        "entropy": masked_mean(entropy, response_mask).item(),
    }

    return loss, metrics
