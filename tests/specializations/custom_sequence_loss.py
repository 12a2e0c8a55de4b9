"""A custom sequence-level policy loss registered WITHOUT any trait (tests of issue 13, item 5).

    l_it = -A_it * exp(s_i),  s_i = sum_t m_it (log pi_it - log pi_old_it) / max(n_i, 1)

s_i is a mean over the WHOLE response i: on a CP slice it would be another number. A custom loss
gets whole responses under CP unless it is registered `token_local=True`, so this one needs no
attribute to be correct at any CP size.
"""

import torch

from stacx.objectives.registry import register_policy_loss

NAME = "sequence_mean_ratio_test"
WRONGLY_TOKEN_LOCAL_NAME = "sequence_mean_ratio_declared_token_local_test"
"""The same loss wrongly declared token-local: under CP it sees slices and its gradient changes
(the guard that the CP test of NAME is not trivially passing)."""


def sequence_mean_ratio(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    per_token, ratio_sum = [], torch.zeros((), dtype=torch.float64)
    for old, new, adv, mask in zip(old_log_prob, log_prob, advantages, loss_masks):
        mask = mask.to(new.dtype)
        mean_log_ratio = ((new - old.detach()) * mask).sum() / mask.sum().clamp(min=1)
        ratio = torch.exp(mean_log_ratio)
        per_token.append(-adv.detach() * ratio)
        ratio_sum = ratio_sum + (ratio.detach().to(torch.float64) * mask.sum())
    return per_token, {"sequence_ratio": ratio_sum}


register_policy_loss(NAME)(sequence_mean_ratio)
register_policy_loss(WRONGLY_TOKEN_LOCAL_NAME, token_local=True)(sequence_mean_ratio)
