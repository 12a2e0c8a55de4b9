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
`stacx/custom/` folder (see `stacx.objectives.discovery`), so a name is found no matter which
module was imported first.
"""

from __future__ import annotations

import difflib

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

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


def is_builtin_entry(entry: object) -> bool:
    """True for an entry defined inside the `stacx` package, except user files in `stacx/custom/`."""
    module = getattr(entry, "__module__", None) or ""
    return module.startswith("stacx.") and not module.startswith("stacx.custom")


def _describe(entry: object) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"


class Registry:
    """One kind of kernel (advantages, policy losses, ...): names and aliases to functions."""

    def __init__(self, kind: str, *, entries_are_callable: bool = True):
        self.kind = kind
        self.entries_are_callable = entries_are_callable
        self._functions: dict[str, Callable] = {}
        self._replaced_builtins: dict[str, tuple[Callable, KernelTraits]] = {}
        """name -> the built-in (and its traits) a user registration replaced (restored by `unregister`)."""
        self._traits: dict[str, KernelTraits] = {}

    def register(self, name: str, *, aliases: Iterable[str] = (), traits: KernelTraits | None = None) -> Callable[[F], F]:
        """Decorator registering a function under `name` (and `aliases`) with its `traits`
        (default `KernelTraits()`); returns the function unchanged."""
        traits = traits if traits is not None else KernelTraits()
        names = [name, *aliases]
        for each in names:
            if not isinstance(each, str) or not each:
                raise ValueError(f"{self.kind} name must be a non-empty string, got {each!r}")

        def decorator(fn: F) -> F:
            if self.entries_are_callable and not callable(fn):
                raise ValueError(f"{self.kind} {name!r}: registered object {fn!r} is not callable")
            replaced = {}
            for each in names:
                if each in self._functions:
                    existing = self._functions[each]
                    if self.entries_are_callable and is_builtin_entry(existing) and not is_builtin_entry(fn):
                        replaced[each] = existing
                        continue
                    raise ValueError(
                        f"{self.kind} {each!r} is already registered (by {_describe(existing)}); registered "
                        f"{self.kind} names: {self.names()}"
                    )
            for each, builtin in replaced.items():
                warnings.warn(
                    f"{self.kind} {each!r}: {_describe(fn)} replaces the built-in {_describe(builtin)} in this "
                    f"process; choose another name to keep both",
                    UserWarning, stacklevel=2,
                )
                self._replaced_builtins[each] = (builtin, self._traits[each])
            for each in names:
                self._functions[each] = fn
                self._traits[each] = traits
            if not is_builtin_entry(fn):
                from stacx.objectives.discovery import record_user_module

                record_user_module(getattr(fn, "__module__", None))
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        from stacx.objectives.discovery import import_builtin_and_custom_modules

        import_builtin_and_custom_modules()
        if name not in self._functions:
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}; {hint}registered {self.kind} names: {self.names()}")
        return self._functions[name]

    def traits(self, name: str) -> KernelTraits:
        """The traits `name` was registered with (looked up like `get`)."""
        self.get(name)
        return self._traits[name]

    def names(self) -> list[str]:
        return sorted(self._functions)

    def all_names(self) -> list[str]:
        """`names()` once the built-in and custom modules have registered theirs."""
        # Imported here: the built-in kernel modules that discovery imports register into this module's registries.
        from stacx.objectives.discovery import import_builtin_and_custom_modules

        import_builtin_and_custom_modules()
        return self.names()

    def unregister(self, name: str) -> None:
        """Remove a name (tests and interactive sessions that redefine a kernel)."""
        if name not in self._functions:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        del self._functions[name]
        del self._traits[name]
        if name in self._replaced_builtins:
            self._functions[name], self._traits[name] = self._replaced_builtins.pop(name)

    def __contains__(self, name: str) -> bool:
        return name in self._functions


ADVANTAGES = Registry("advantage estimator")
"""`fn(config, rollout_data) -> list[Tensor]`, one (response_len_i,) tensor per trajectory."""

POLICY_LOSSES = Registry("policy loss")
"""`fn(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs) -> (list[Tensor], dict)`; the
diffusion kernel `flow_grpo_clip` takes the same lists with denoising steps in place of tokens."""

KL_ESTIMATORS = Registry("KL estimator")
"""`fn(log_prob, ref_log_prob) -> Tensor`, elementwise on tensors of any (equal) shape."""

OFF_POLICY_CORRECTIONS = Registry("off-policy correction")
"""`fn(config, train_log_prob, rollout_log_prob, loss_masks, **kwargs) -> OffPolicyCorrection`."""

LOSSES = Registry("loss")
"""Other loss kernels (value, SFT, DPO, distillation, the flow-matching losses of
`diffusion_loss.py`); each documents its own signature."""

AGGREGATIONS = Registry("aggregation mode", entries_are_callable=False)
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
