"""A custom algorithm in one file: an advantage estimator and a policy loss, selected by name.

Use it with
    stacx train --custom-module examples/custom_algorithm/my_algo.py --config examples/configs/grpo.yaml \
        --advantage-estimator rank_centered --policy-loss tempered_pg --algorithm-param pg_temperature=0.5

(in a config file: algorithm: {advantage_estimator: rank_centered, policy_loss: tempered_pg, pg_temperature: 0.5}).

Both functions follow the Stacx contracts: per-trajectory lists of (response_len_i,) tensors
in, per-token losses out (no aggregation), metrics as loss-mask-weighted sums. Custom
hyperparameters (`rank_scale`, `pg_temperature`) are read from the algorithm config and declared
at registration (`hyperparameters=`), so a misspelled `--algorithm-param pg_temprature=0.5` is
refused before the run starts, with a "did you mean".
"""

import torch

from stacx.objectives.registry import register_advantage, register_policy_loss


@register_advantage("rank_centered", hyperparameters=("rank_scale",))
def rank_centered(config, rollout_data):
    """A_i = rank_scale * (rank of r_i within its prompt group, scaled to [-1, 1]).

    Ranks are robust to reward scale; ties share their average rank; a group of one gets 0.
    """
    scale = float(getattr(config, "rank_scale", 1.0))
    rewards = torch.as_tensor(rollout_data["rewards"], dtype=torch.float64)
    prompt_ids = list(rollout_data["prompt_id"])
    lengths = [int(n) for n in rollout_data["response_lengths"]]
    advantages = torch.zeros_like(rewards)
    for key in dict.fromkeys(prompt_ids):
        members = [i for i, p in enumerate(prompt_ids) if p == key]
        group = rewards[members]
        if len(members) == 1:
            continue
        # average rank: number of smaller rewards + half the number of equal others
        less = (group.unsqueeze(1) > group.unsqueeze(0)).sum(1).to(torch.float64)
        equal = (group.unsqueeze(1) == group.unsqueeze(0)).sum(1).to(torch.float64) - 1
        rank = less + 0.5 * equal  # in [0, n - 1]
        advantages[members] = scale * (2.0 * rank / (len(members) - 1) - 1.0)
    return [torch.full((n,), float(a), dtype=torch.float32) for a, n in zip(advantages.tolist(), lengths)]


@register_policy_loss("tempered_pg", hyperparameters=("pg_temperature",))
def tempered_pg(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    """l_t = -A_t * rho_t^tau with rho_t = exp(log pi_t - log pi_old_t), tau = pg_temperature.

    tau = 1 is the importance-weighted policy gradient; tau < 1 damps large ratios smoothly.
    """
    tau = float(getattr(config, "pg_temperature", 1.0))
    lengths = [t.shape[0] for t in log_prob]
    log_ratio = (torch.cat(log_prob) - torch.cat(old_log_prob).detach()).clamp(-20.0, 20.0)
    loss = -torch.cat(advantages).detach() * torch.exp(tau * log_ratio)
    mask = torch.cat(loss_masks).to(loss.dtype)
    metrics = {
        "pg_loss": (loss.detach() * mask).sum(),
        "tempered_ratio": (torch.exp(tau * log_ratio.detach()) * mask).sum(),
    }
    return list(loss.split(lengths)), metrics
