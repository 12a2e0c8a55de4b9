"""A plugin written in the padded (batch, seq_len) style of other frameworks, adapted by name.

Loaded by the adapter tests with `load_custom_modules`; the function bodies are written the
way such plugins usually are (padded tensors, response_mask, agg_loss, .item() metrics).
"""

import torch

from stacx.objectives import agg_loss, masked_mean
from stacx.objectives.adapters import register_padded_advantage, register_padded_policy_loss


@register_padded_advantage("padded_centered_advantage")
def centered_advantage(token_level_rewards, response_mask, gamma=1.0, **kwargs):
    rewards = (token_level_rewards * response_mask).sum(dim=-1)
    advantages = (rewards - rewards.mean()).unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_padded_policy_loss("padded_clip_loss", aggregation="token-mean")
def clip_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2, importance_weights=None, **kwargs):
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20, 20))
    clipped = torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if importance_weights is not None:
        loss = loss * importance_weights.unsqueeze(-1)
    loss = agg_loss(loss, response_mask, mode="token-mean")
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "ratio_mean": masked_mean(ratio, response_mask).item(),
            "clip_frac": masked_mean((ratio != clipped).float(), response_mask).item(),
        }
    return loss, metrics


@register_padded_policy_loss("padded_seq_mean_loss", aggregation="seq-mean-token-mean")
def seq_mean_loss(old_log_prob, log_prob, advantages, response_mask, **kwargs):
    loss = -advantages * torch.exp(log_prob - old_log_prob)
    return agg_loss(loss, response_mask, mode="seq-mean-token-mean"), {}


@register_padded_policy_loss("padded_per_token_loss")
def per_token_loss(old_log_prob, log_prob, advantages, response_mask, entropy_coef=0.0, entropy=None, **kwargs):
    loss = -advantages * log_prob
    if entropy is not None:
        loss = loss - entropy_coef * entropy
    return loss * response_mask, {"entropy": masked_mean(entropy, response_mask).item() if entropy is not None else 0.0}
