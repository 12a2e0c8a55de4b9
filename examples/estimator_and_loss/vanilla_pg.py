# A custom policy loss: the unclipped importance-weighted policy gradient -ratio_t * A_t, registered by name.
# `vanilla_pg` is also a built-in name: this registration replaces it (with a warning).
#   stacx train --custom-module examples/estimator_and_loss/vanilla_pg.py --policy-loss vanilla_pg ...
import torch

from stacx.objectives.registry import register_policy_loss

@register_policy_loss("vanilla_pg")
def vanilla_pg(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    lengths = [len(t) for t in log_prob]
    ratio = torch.exp(torch.cat(log_prob) - torch.cat(old_log_prob))
    per_token_loss = -(ratio * torch.cat(advantages))
    approx_kl = ((torch.cat(old_log_prob) - torch.cat(log_prob)) * torch.cat(loss_masks)).sum()
    return list(per_token_loss.split(lengths)), {"approx_kl": approx_kl.item()}
