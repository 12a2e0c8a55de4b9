"""Stateless loss kernels and advantage estimators (pure math on per-trajectory tensor lists).

Imports torch only, never torch.distributed. Kernels are found by name in the registries of
`stacx.objectives.registry`; every module of this package (at import) and of `stacx/custom/` (at
the first lookup) is imported automatically, user files with `load_custom_modules` (`--custom-module my_algo.py`).
See docs/objectives.md.
"""

from stacx.objectives.aggregation import (
    AggregationMode,
    agg_loss,
    aggregate_mean,
    aggregate_sum,
    count_normalizer,
    loss_token_count,
    loss_token_counts,
    masked_mean,
    masked_sum,
    normalizer_kind,
    register_aggregation_mode,
    sum_of_sample_mean,
)
from stacx.plugins.discovery import import_builtin_and_custom_modules, import_builtin_modules, load_custom_modules
from stacx.objectives.registry import (
    get_advantage,
    get_kl_estimator,
    get_loss,
    get_off_policy_correction,
    get_policy_loss,
    list_advantages,
    list_aggregation_modes,
    list_kl_estimators,
    list_losses,
    list_off_policy_corrections,
    list_policy_losses,
    register_advantage,
    register_kl_estimator,
    register_loss,
    register_off_policy_correction,
    register_policy_loss,
)

__all__ = [
    "AggregationMode", "agg_loss", "aggregate_mean", "aggregate_sum", "count_normalizer", "loss_token_count", "loss_token_counts",
    "masked_mean", "masked_sum", "register_aggregation_mode", "sum_of_sample_mean",
    "normalizer_kind", "import_builtin_and_custom_modules", "import_builtin_modules", "load_custom_modules",
    "get_advantage", "get_kl_estimator", "get_loss", "get_off_policy_correction", "get_policy_loss",
    "list_advantages", "list_aggregation_modes", "list_kl_estimators", "list_losses",
    "list_off_policy_corrections", "list_policy_losses", "register_advantage",
    "register_kl_estimator", "register_loss", "register_off_policy_correction", "register_policy_loss",
]

# Built-ins only: `stacx/custom/` files may import the trainer, which imports this package; they
# are imported at the first registry lookup (stacx.plugins.discovery).
import_builtin_modules()
