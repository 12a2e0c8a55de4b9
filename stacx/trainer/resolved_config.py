"""The algorithm hyperparameters a run trains with: the recipe's defaults under the user's settings.

Precedence, lowest first:
    generic defaults (ALGORITHM_FIELDS)
    < the recipe's AlgorithmDefaults (grpo's clip ratios, ppo's lam, ...)
    < settings of other sections the kernels read (rollout_temperature, distill_kl_mode, teacher_top_k)
    < every key the user set (`RunConfig.algorithm.given_keys`), custom keys included
    < the `STACX_*` environment overrides (`apply_run_env_overrides`), read once here.

"Set" means given, not "different from the generic default": `lam: 1.0` under ppo stays 1.0.
The resolved config's `given_keys` are the keys the user set (recipe defaults excluded).
Guide 001's spelling is accepted: `algorithm: {name: my_loss, adv_estimator: my_advantage}`
selects the registered policy loss `my_loss` and the estimator `my_advantage`.
A user `clip_ratio` without explicit bounds sets both clip bounds (it is the more specific choice
than the recipe's default bounds).
"""

from __future__ import annotations

from typing import Any

from stacx.trainer.run_config import AlgorithmConfig

CLIP_BOUNDS = ("clip_ratio_low", "clip_ratio_high")
ESTIMATOR_ALIASES = ("adv_estimator",)
"""Other frameworks' names for `advantage_estimator` (guide 001's `adv_estimator`), accepted as it."""


def policy_loss_named_by_algorithm(run_config) -> str | None:
    """Guide 001: `algorithm.name` (or --algorithm) naming a registered policy loss, not a recipe,
    selects that loss (in the recipe its estimator infers). None otherwise."""
    from stacx.objectives.registry import POLICY_LOSSES
    from stacx.trainer.recipes import TRAINING_CONFIGS

    name = run_config.train.algorithm
    if name and name not in TRAINING_CONFIGS and name in POLICY_LOSSES:
        return name
    return None


def user_algorithm_values(run_config) -> dict[str, Any]:
    """The algorithm keys the user set: a given clip_ratio expanded into unset clip bounds,
    `adv_estimator` taken as `advantage_estimator`, and a policy loss named by `algorithm.name`."""
    given = run_config.algorithm.given_values()
    if "clip_ratio" in given:
        for bound in CLIP_BOUNDS:
            given.setdefault(bound, given["clip_ratio"])
    for alias in ESTIMATOR_ALIASES:
        if alias in given:
            estimator = given.pop(alias)
            if given.setdefault("advantage_estimator", estimator) != estimator:
                raise ValueError(f"algorithm.{alias} is {estimator!r} but algorithm.advantage_estimator is "
                                 f"{given['advantage_estimator']!r}; set only one of them")
    named_loss = policy_loss_named_by_algorithm(run_config)
    if named_loss is not None:
        if given.setdefault("policy_loss", named_loss) != named_loss:
            raise ValueError(f"algorithm.name {named_loss!r} names a policy loss but algorithm.policy_loss is "
                             f"{given['policy_loss']!r}; set only one of them")
        given.pop("name", None)
    return given


def apply_run_env_overrides(run_config, environ=None):
    """The run config with the `STACX_*` overrides (stacx.rollout.env_overrides) applied to its
    teacher section, read ONCE, in the process that resolves the run (the Ray driver, or each
    torchrun rank). Everything downstream (the driver's teacher top-K request, the roll-in, the
    workers, which receive this object) sees the same values; workers never read their own env."""
    import dataclasses

    from stacx.rollout.env_overrides import apply_env_overrides

    teacher = apply_env_overrides(run_config.teacher, environ)
    return run_config if teacher is run_config.teacher else dataclasses.replace(run_config, teacher=teacher)


def resolve_algorithm_config(training_config, run_config, environ=None) -> AlgorithmConfig:
    """AlgorithmConfig = recipe defaults, run-section settings the kernels read, then every key the
    user set; `name` = the recipe."""
    run_config = apply_run_env_overrides(run_config, environ)
    values = training_config.algorithm.as_algorithm_values(training_config.name) if training_config.algorithm else {}
    # Settings of other sections the specializations read as config.<name> (the sampling temperature
    # of training log-probs, the distillation mode), unless the algorithm section sets them itself.
    values.update(rollout_temperature=run_config.rollout.rollout_temperature,
                  distill_kl_mode=run_config.teacher.distill_kl_mode, teacher_top_k=run_config.teacher.teacher_top_k)
    user_values = user_algorithm_values(run_config)
    values.update(user_values)
    from stacx.rollout.env_overrides import read_env_overrides

    if "distill_kl_mode" in read_env_overrides(environ):  # STACX_* wins over file and flags
        values["distill_kl_mode"] = run_config.teacher.distill_kl_mode
    values["name"] = training_config.name
    config = AlgorithmConfig(**values)
    # given_keys of the resolved config = what the USER set (file, flags): plugin adapters pass a
    # hyperparameter only when it was set, so a plugin's own default is not overwritten by ours.
    config._given_keys = frozenset(user_values)
    return config


def resolved_run_config_dict(run_config, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """The run config as saved with checkpoints: every section, the algorithm as trained."""
    out = run_config.to_dict()
    out["algorithm"] = algorithm.to_dict()
    return out
