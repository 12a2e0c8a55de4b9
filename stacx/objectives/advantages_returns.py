"""Token-level advantages from discounted returns: reinforce_plus_plus(_baseline), gae.

Per-token reward of trajectory i, response token t (T_i tokens):

    r_it = token_rewards_it - beta * KL_est(log pi_old_it, log pi_ref_it) + [t = T_i - 1] R_i

R_i is the scalar reward (`rewards`), `token_rewards` is optional, and the KL-in-reward term is
on when config `use_kl_in_reward` is set (beta = `kl_in_reward_coef`, estimator
`kl_in_reward_type`, default k1); it reads `log_probs` (the rollout policy's log-probs as
recomputed by the trainer; falls back to `rollout_log_probs`) and `ref_log_probs`.
Outputs are lists of (T_i,) float32 tensors.
"""

from __future__ import annotations

import torch

from stacx.objectives.advantages_group import group_normalized_rewards
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import get_kl_estimator, register_advantage
from stacx.objectives.validation import (
    check_scalars_per_trajectory,
    check_trajectory_lists,
    rollout_field,
)


def token_level_rewards(config: AlgorithmConfig, rollout_data,
                        scalar_rewards: torch.Tensor | None = None) -> list[torch.Tensor]:
    """r_it as in the module docstring, float64; `scalar_rewards` overrides `rewards`."""
    lengths = [int(n) for n in rollout_field(rollout_data, "response_lengths")]
    if scalar_rewards is None:
        scalar_rewards = check_scalars_per_trajectory("rewards", rollout_field(rollout_data, "rewards"), len(lengths))
    scalar_rewards = scalar_rewards.detach().to(torch.float64)
    token_rewards = rollout_field(rollout_data, "token_rewards", required=False)
    if token_rewards is not None:
        _check_lengths("token_rewards", token_rewards, lengths)
        per_token = [t.detach().to(torch.float64).clone() for t in token_rewards]
    else:
        per_token = [torch.zeros(n, dtype=torch.float64) for n in lengths]
    if config.use_kl_in_reward:
        beta = float(config.kl_in_reward_coef)
        log_probs = rollout_field(rollout_data, "log_probs", required=False)
        if log_probs is None:
            log_probs = rollout_field(rollout_data, "rollout_log_probs", required=False)
        if log_probs is None:
            raise ValueError("use_kl_in_reward needs rollout_data field 'log_probs' (or 'rollout_log_probs')")
        ref_log_probs = rollout_field(rollout_data, "ref_log_probs")
        _check_lengths("log_probs", log_probs, lengths)
        _check_lengths("ref_log_probs", ref_log_probs, lengths)
        estimator = get_kl_estimator(config.kl_in_reward_type)
        for rewards_t, lp, ref in zip(per_token, log_probs, ref_log_probs):
            rewards_t -= beta * estimator(lp.detach().to(torch.float64), ref.detach().to(torch.float64))
    for index, (rewards_t, reward) in enumerate(zip(per_token, scalar_rewards.tolist())):
        if rewards_t.numel() > 0:
            rewards_t[-1] += reward
    return per_token


def _check_lengths(name: str, tensors, lengths: list[int]) -> None:
    if len(tensors) != len(lengths):
        raise ValueError(f"{name} has {len(tensors)} trajectories but response_lengths has {len(lengths)}")
    for index, (tensor, n) in enumerate(zip(tensors, lengths)):
        if tensor.dim() != 1 or tensor.shape[0] != n:
            raise ValueError(f"{name}[{index}] has shape {tuple(tensor.shape)} but response_lengths[{index}] is {n}")


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) r_k for one trajectory, (T,) -> (T,)."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(())
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def _loss_masks(rollout_data, lengths: list[int]) -> list[torch.Tensor]:
    masks = rollout_field(rollout_data, "loss_masks", required=False)
    if masks is None:
        return [torch.ones(n, dtype=torch.float64) for n in lengths]
    _check_lengths("loss_masks", masks, lengths)
    return [m.detach().to(torch.float64) for m in masks]


def masked_whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """(x - mean) / (std + eps) with mean and population std over all masked tokens of the batch;
    masked-out tokens become 0."""
    flat_x = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    flat_m = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.float64)
    count = flat_m.sum().clamp_min(1e-8)
    mean = (flat_x * flat_m).sum() / count
    var = ((flat_x - mean).square() * flat_m).sum() / count
    scale = var.sqrt() + eps
    return [((x - mean) / scale) * m for x, m in zip(values, masks)]


def _as_float32(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.to(torch.float32) for v in values]


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """REINFORCE++: A_it = whiten(G_it), G_it = sum_{k >= t} gamma^(k-t) r_ik.

    r_ik as in the module docstring (KL-in-reward included when enabled); whitening uses the
    mean and std over every loss-masked token of the batch (`loss_masks`, default all ones).
    config: `gamma` (1.0), `use_kl_in_reward`, `kl_in_reward_coef`, `adv_eps` (1e-6).
    """
    gamma = float(config.gamma)
    rewards = token_level_rewards(config, rollout_data)
    lengths = [r.shape[0] for r in rewards]
    returns = [discounted_returns(r, gamma) for r in rewards]
    eps = float(config.adv_eps)
    return _as_float32(masked_whiten(returns, _loss_masks(rollout_data, lengths), eps))


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """REINFORCE++-baseline: REINFORCE++ with R_i replaced by R_i - mean_g(R) (prompt group g).

    A_it = whiten(G_it) where the last-token reward is the group-centred R_i; groups of one
    get a centred reward of 0. Same config as `reinforce_plus_plus`.
    """
    centered = group_normalized_rewards(rollout_data, normalize_std=False, eps=0.0)
    gamma = float(config.gamma)
    rewards = token_level_rewards(config, rollout_data, scalar_rewards=centered)
    lengths = [r.shape[0] for r in rewards]
    returns = [discounted_returns(r, gamma) for r in rewards]
    eps = float(config.adv_eps)
    return _as_float32(masked_whiten(returns, _loss_masks(rollout_data, lengths), eps))


def gae_advantages_and_returns(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for one trajectory: (T,) rewards and values -> (advantages, returns), each (T,).

    delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0); A_t = delta_t + gamma lam A_{t+1};
    returns_t = A_t + V_t (the value-loss target).
    """
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(())
    next_advantage = rewards.new_zeros(())
    for t in range(rewards.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    return advantages, advantages + values


def gae_returns(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """The value targets A_t + V_t of `gae` (unwhitened), for the critic's value loss."""
    return [ret.to(torch.float32) for _, ret in _gae_all(config, rollout_data)]


def _gae_all(config: AlgorithmConfig, rollout_data):
    gamma = float(config.gamma)
    lam = float(config.lam)
    rewards = token_level_rewards(config, rollout_data)
    values = rollout_field(rollout_data, "values")
    check_trajectory_lists("token_level_rewards", rewards, values=values)
    return [gae_advantages_and_returns(r, v.detach().to(torch.float64), gamma, lam) for r, v in zip(rewards, values)]


@register_advantage("gae")
def gae(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """PPO's generalized advantage estimation with a critic's `values` (one per response token).

    delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = sum_k (gamma lam)^k delta_{t+k}.
    config: `gamma` (1.0), `lam` (1.0), `whiten_advantages` (False: batch whitening over
    masked tokens as in REINFORCE++), KL-in-reward as in the module docstring.
    """
    advantages = [adv for adv, _ in _gae_all(config, rollout_data)]
    if config.whiten_advantages:
        lengths = [a.shape[0] for a in advantages]
        eps = float(config.adv_eps)
        advantages = masked_whiten(advantages, _loss_masks(rollout_data, lengths), eps)
    return _as_float32(advantages)
