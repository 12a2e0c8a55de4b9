"""Outcome-reward advantages with group or batch baselines: grpo, dr_grpo, rloo, reward_centered.

Each is `fn(config, rollout_data) -> list[Tensor]`: one scalar advantage per trajectory,
broadcast to its response tokens, shape (response_len_i,), float32. `rollout_data` fields
used: `rewards` (a float64 tensor `[num_trajectories]`, one reward per trajectory), `prompt_id` (group key: trajectories sampled from
the same prompt share it), `response_lengths`, and optionally `episode_id`.

An episode counts once. An agent episode whose session branched (stacx.rollout.agents.agent_trajectories)
gives several trajectories with the episode's reward, the same `prompt_id` and the same
`episode_id`; the group (or batch) statistics are taken over episodes, each the mean reward of its
trajectories, and every trajectory gets its episode's advantage. Counting each branch would let an
episode that retried three times weigh three times in its group's mean and std. Trajectories
without an `episode_id` (None, or the field absent) are each their own episode.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import register_advantage
from stacx.objectives.validation import check_scalars_per_trajectory, rollout_field


def _rewards_and_lengths(rollout_data) -> tuple[torch.Tensor, list[int]]:
    lengths = [int(n) for n in rollout_field(rollout_data, "response_lengths")]
    for index, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"response_lengths[{index}] is negative ({n})")
    rewards = check_scalars_per_trajectory("rewards", rollout_field(rollout_data, "rewards"), len(lengths))
    return rewards.detach().to(torch.float64), lengths


def group_indices(prompt_ids, num_trajectories: int) -> list[list[int]]:
    """Trajectory indices grouped by prompt id, in first-seen order."""
    prompt_ids = list(prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)
    if len(prompt_ids) != num_trajectories:
        raise ValueError(f"prompt_id has {len(prompt_ids)} entries but there are {num_trajectories} trajectories")
    groups: dict[object, list[int]] = defaultdict(list)
    for index, key in enumerate(prompt_ids):
        groups[key].append(index)
    return list(groups.values())


def episodes_of(members: list[int], episode_ids) -> list[list[int]]:
    """`members` (trajectory indices) grouped by episode, in first-seen order; each trajectory whose
    episode id is None (or every one, when `episode_ids` is None) is an episode of its own."""
    if episode_ids is None:
        return [[index] for index in members]
    episodes: dict[object, list[int]] = {}
    for index in members:
        key = episode_ids[index]
        episodes.setdefault(("own", index) if key is None else ("episode", key), []).append(index)
    return list(episodes.values())


def _episode_ids(rollout_data, num_trajectories: int):
    episode_ids = rollout_field(rollout_data, "episode_id", required=False)
    if episode_ids is None:
        return None
    episode_ids = list(episode_ids.tolist() if isinstance(episode_ids, torch.Tensor) else episode_ids)
    if len(episode_ids) != num_trajectories:
        raise ValueError(f"episode_id has {len(episode_ids)} entries but there are {num_trajectories} trajectories")
    return episode_ids


def broadcast_to_tokens(per_trajectory: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """(B,) scalars -> list of (response_len_i,) float32 tensors filled with each scalar."""
    return [torch.full((n,), float(value), dtype=torch.float32) for value, n in zip(per_trajectory.tolist(), lengths)]


def group_normalized_rewards(rollout_data, *, normalize_std: bool, eps: float, leave_one_out: bool = False) -> torch.Tensor:
    """Per-trajectory advantage (B,) float64 from group statistics (see `grpo`, `rloo`)."""
    rewards, lengths = _rewards_and_lengths(rollout_data)
    episode_ids = _episode_ids(rollout_data, len(lengths))
    advantages = torch.zeros_like(rewards)
    for members in group_indices(rollout_field(rollout_data, "prompt_id"), len(lengths)):
        episodes = episodes_of(members, episode_ids)
        group = torch.stack([rewards[episode].mean() for episode in episodes])
        n = len(episodes)
        if n == 1:
            continue  # a lone episode is its own baseline: advantage 0
        centered = group - group.mean()
        if leave_one_out:
            centered = centered * (n / (n - 1))
        if normalize_std:
            centered = centered / (group.std(unbiased=True) + eps)
        for episode, value in zip(episodes, centered):
            advantages[episode] = value
    return advantages


@register_advantage("grpo")
def grpo(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """GRPO: A_i = (r_i - mean_g(r)) / (std_g(r) + eps), broadcast to every response token.

    g is the prompt group of trajectory i; std is the unbiased sample std of the group.
    config: `norm_adv_by_std` (default True; False gives Dr. GRPO), `adv_eps` (1e-6).
    A group of one gets A = 0; a zero-variance group gets A = 0 (numerator 0, no NaN).
    """
    normalize = bool(config.norm_adv_by_std)
    eps = float(config.adv_eps)
    _, lengths = _rewards_and_lengths(rollout_data)
    return broadcast_to_tokens(group_normalized_rewards(rollout_data, normalize_std=normalize, eps=eps), lengths)


@register_advantage("dr_grpo")
def dr_grpo(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """Dr. GRPO: A_i = r_i - mean_g(r) (no std division), broadcast to tokens.

    Pair it with `loss_agg_mode: seq-mean-token-sum-norm` to also drop the length bias.
    """
    _, lengths = _rewards_and_lengths(rollout_data)
    return broadcast_to_tokens(group_normalized_rewards(rollout_data, normalize_std=False, eps=0.0), lengths)


@register_advantage("rloo")
def rloo(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """RLOO: A_i = r_i - mean_{j in g, j != i} r_j = n/(n-1) (r_i - mean_g(r)), broadcast.

    A group of one gets A = 0.
    """
    _, lengths = _rewards_and_lengths(rollout_data)
    return broadcast_to_tokens(
        group_normalized_rewards(rollout_data, normalize_std=False, eps=0.0, leave_one_out=True), lengths
    )


@register_advantage("reward_centered")
def reward_centered(config: AlgorithmConfig, rollout_data) -> list[torch.Tensor]:
    """The minimal estimator: A_i = r_i - mean_batch(r), broadcast to tokens (the mean over episodes)."""
    rewards, lengths = _rewards_and_lengths(rollout_data)
    episodes = episodes_of(list(range(len(lengths))), _episode_ids(rollout_data, len(lengths)))
    baseline = torch.stack([rewards[episode].mean() for episode in episodes]).mean() if episodes else rewards.sum()
    return broadcast_to_tokens(rewards - baseline, lengths)
