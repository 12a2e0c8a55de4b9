# A custom advantage estimator: each reward minus the batch's mean reward, registered by name.
# `reward_centered` is also a built-in name: this registration replaces it (with a warning).
#   stacx train --custom-module examples/estimator_and_loss/reward_centered.py --advantage-estimator reward_centered ...
import torch

from stacx.objectives.registry import register_advantage

@register_advantage("reward_centered")
def reward_centered(config, rollout_data):
    rewards = torch.tensor(rollout_data["rewards"], dtype=torch.float32)
    lengths = rollout_data["response_lengths"]
    adv = rewards - rewards.mean()
    return list(torch.repeat_interleave(adv, torch.tensor(lengths)).split(lengths))
