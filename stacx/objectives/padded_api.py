"""Guide 001's plugin API under Stacx's package path: padded (batch, seq_len) plugins as written.

    from stacx.objectives.padded_api import register_adv_estimator, register_policy_loss, masked_mean, agg_loss

`register_policy_loss` / `register_adv_estimator` here are the padded adapters
(`stacx.objectives.adapters.register_padded_policy_loss` / `register_padded_advantage`): the
plugin keeps its signature `fn(old_log_prob, log_prob, advantages, response_mask, **hp)` and
Stacx converts to and from its per-trajectory contract (see adapters.py for what is passed,
how a scalar loss is spread, and how plugin defaults, entropy bonuses and importance weights
are honoured). Native Stacx kernels use `stacx.objectives.registry` instead.
"""

from stacx.objectives.adapters import register_padded_advantage as register_adv_estimator
from stacx.objectives.adapters import register_padded_policy_loss as register_policy_loss
from stacx.objectives.aggregation import agg_loss, masked_mean

__all__ = ["agg_loss", "masked_mean", "register_adv_estimator", "register_policy_loss"]
