"""Name -> function registries for every loss kernel and estimator.

    from stacx.objectives.registry import register_advantage, register_policy_loss

    @register_advantage("my_adv")
    def my_adv(config: AlgorithmConfig, rollout_data) -> list[Tensor]: ...

    @register_policy_loss("my_loss")
    def my_loss(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs): ...

The run config selects kernels by name (`algorithm.advantage_estimator`, `algorithm.policy_loss`,
`algorithm.kl_loss_type`, ...). Registering a name twice, or looking up an unknown name, raises
`ValueError` listing the registered names, with one exception: a user module (anything outside
the `stacx` package, or in `stacx/custom/`) may re-register a *built-in* kernel's name. The user's
function then replaces the built-in for this process, with a `UserWarning` naming both; so a guide
example that reuses a built-in name (`reward_centered`, `vanilla_pg`) runs as written.
`unregister` of such a name restores the built-in. Lookups first import every built-in module and the
`stacx/custom/` folder (see `stacx.plugins.discovery`), so a name is found no matter which
module was imported first. Each registry is a `stacx.plugins.registry.Registry`, the one every kind of
plugin uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

from stacx.plugins.registry import Registry

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True, kw_only=True)
class KernelTraits:
    """What the framework must know about a registered kernel to call it correctly, declared where
    the kernel is registered (`@register_policy_loss("x", token_local=True)`)."""

    token_local: bool = False
    """The per-token loss (or correction) at token t depends only on token t's inputs, so under
    context parallelism it may run on this rank's slice of each response. False (the default, and
    the safe choice for any custom kernel): it is given WHOLE responses, gathered over CP in one
    collective per micro-batch (sequence ratios, sequence masks, statistics over a response)."""
    uses_current_policy: bool = False
    """Off-policy corrections only: compare the CURRENT policy's log-probs (not pi_old) with the
    rollout engine's (opsm, m2po)."""
    applies_entropy_bonus: bool = False
    """Policy losses only: the kernel adds its own entropy bonus (a padded plugin taking
    `entropy_coef`), so the framework adds none (no term is counted twice)."""
    applies_importance_weights: bool = False
    """Policy losses only: the kernel multiplies by the `importance_weights` it is passed (a padded
    plugin taking `importance_weights`), so the framework does not apply them again."""
    hyperparameters: tuple[str, ...] = ()
    """The knobs the kernel reads from its config (`pg_temperature`), declared so that a misspelled
    `--algorithm-param` (or `algorithm:` key) is refused before the run starts, with a "did you mean"
    (`stacx.trainer.preflight.check_objective_names`). A padded plugin declares its named parameters.
    Empty: the kernel declares nothing, and no custom key is checked against it."""


ADVANTAGES = Registry("advantage estimator", user_may_replace_builtins=True, default_traits=KernelTraits())
"""`fn(config, rollout_data) -> list[Tensor]`, one (response_len_i,) tensor per trajectory."""

POLICY_LOSSES = Registry("policy loss", user_may_replace_builtins=True, default_traits=KernelTraits())
"""`fn(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs) -> (list[Tensor], dict)`; the
diffusion kernel `flow_grpo_clip` takes the same lists with denoising steps in place of tokens."""

KL_ESTIMATORS = Registry("KL estimator", user_may_replace_builtins=True, default_traits=KernelTraits())
"""`fn(log_prob, ref_log_prob) -> Tensor`, elementwise on tensors of any (equal) shape."""

OFF_POLICY_CORRECTIONS = Registry("off-policy correction", user_may_replace_builtins=True, default_traits=KernelTraits())
"""`fn(config, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection`."""

LOSSES = Registry("loss", user_may_replace_builtins=True, default_traits=KernelTraits())
"""Other loss kernels (value, SFT, DPO, distillation, the flow-matching losses of
`diffusion_loss.py`); each documents its own signature."""

AGGREGATIONS = Registry("aggregation mode", entries_are_callable=False, default_traits=KernelTraits())
"""Loss aggregation modes (`token-mean`, ...): `AggregationMode` objects, see aggregation.py."""


def register_advantage(name: str, *, aliases: Iterable[str] = (), hyperparameters: Iterable[str] = ()):
    """`hyperparameters`: the knobs the estimator reads from its config (see `KernelTraits.hyperparameters`)."""
    return ADVANTAGES.register(name, aliases=aliases, traits=KernelTraits(hyperparameters=tuple(hyperparameters)))


def register_policy_loss(name: str, *, aliases: Iterable[str] = (), token_local: bool = False,
                         hyperparameters: Iterable[str] = (), traits: KernelTraits | None = None):
    """`token_local=True` declares that loss_t depends only on token t (it may then run on CP
    slices); without it the loss gets whole responses under context parallelism. `hyperparameters`:
    the knobs the loss reads from its config (`KernelTraits.hyperparameters`). `traits` (adapters)
    replaces both. A function whose first parameter is `old_log_prob` (a padded
    plugin, `fn(old_log_prob, log_prob, advantages, response_mask, ...)`) is refused here, at
    registration, instead of failing when it is first called."""
    if traits is None:
        traits = KernelTraits(token_local=token_local, hyperparameters=tuple(hyperparameters))
    register = POLICY_LOSSES.register(name, aliases=aliases, traits=traits)

    def decorator(fn: F) -> F:
        _refuse_padded_signature(name, fn)
        return register(fn)

    return decorator


def _refuse_padded_signature(name: str, fn: Callable) -> None:
    import inspect

    try:
        parameters = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return
    if parameters[:1] == ["old_log_prob"]:
        raise ValueError(
            f"policy loss {name!r}: {getattr(fn, '__qualname__', fn)} takes (old_log_prob, log_prob, advantages, "
            "response_mask, ...) - a padded-tensor plugin; Stacx losses take (config, old_log_prob, log_prob, "
            "advantages, loss_masks, **kwargs). Register it with stacx.objectives.adapters.register_padded_policy_loss "
            "(or import register_policy_loss from stacx.objectives.padded_api)"
        )


def register_kl_estimator(name: str, *, aliases: Iterable[str] = ()):
    return KL_ESTIMATORS.register(name, aliases=aliases)


def register_off_policy_correction(name: str, *, aliases: Iterable[str] = (), token_local: bool = False,
                                   uses_current_policy: bool = False, hyperparameters: Iterable[str] = ()):
    """Traits as for policy losses; `uses_current_policy=True`: the correction compares the current
    policy (not pi_old) with the rollout engine."""
    traits = KernelTraits(token_local=token_local, uses_current_policy=uses_current_policy,
                          hyperparameters=tuple(hyperparameters))
    return OFF_POLICY_CORRECTIONS.register(name, aliases=aliases, traits=traits)


def register_loss(name: str, *, aliases: Iterable[str] = ()):
    return LOSSES.register(name, aliases=aliases)


# Look-ups by name; an unknown name raises ValueError with the closest and the registered names.
get_advantage = ADVANTAGES.get
get_policy_loss = POLICY_LOSSES.get
get_kl_estimator = KL_ESTIMATORS.get
get_off_policy_correction = OFF_POLICY_CORRECTIONS.get
get_loss = LOSSES.get
get_policy_loss_traits = POLICY_LOSSES.traits
get_off_policy_correction_traits = OFF_POLICY_CORRECTIONS.traits
get_advantage_traits = ADVANTAGES.traits


# Every registered name, the built-in and custom modules imported first.
list_advantages = ADVANTAGES.all_names
list_policy_losses = POLICY_LOSSES.all_names
list_kl_estimators = KL_ESTIMATORS.all_names
list_off_policy_corrections = OFF_POLICY_CORRECTIONS.all_names
list_losses = LOSSES.all_names
list_aggregation_modes = AGGREGATIONS.all_names
