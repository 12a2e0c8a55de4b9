"""The algorithm hyperparameters a run trains with: the recipe's defaults under the user's settings.

Precedence, lowest first:
    the declared defaults (the AlgorithmConfig dataclass, stacx.objectives.algorithm_config)
    < the recipe's overrides (`recipe_algorithm(...)`: grpo's clip ratios, ppo's value_clip, ...)
    < settings of other sections the kernels read (rollout_temperature, distill_kl_mode, teacher_top_k)
    < every key the user set (`RunConfig.algorithm.given_keys`), custom keys included
    < the `STACX_*` environment overrides (`apply_run_env_overrides`), read once here.

"Set" means given, not "different from the generic default": `lam: 1.0` under ppo stays 1.0.
The resolved config's `given_keys` are the keys the user set (recipe defaults excluded).
Guide 001's spelling is accepted: `algorithm: {name: my_loss, adv_estimator: my_advantage}`
selects the registered policy loss `my_loss` and the estimator `my_advantage`. In such a Flux-style
section (one with `adv_estimator`) `name` is the policy loss even where it also names a recipe
(`name: ppo` is the PPO-clip loss, with a warning), as Flux users mean it.
A user `clip_ratio` without explicit bounds sets both clip bounds (it is the more specific choice
than the recipe's default bounds).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from stacx.env_overrides import apply_env_overrides, read_env_overrides
from stacx.objectives.registry import POLICY_LOSSES
from stacx.trainer.config.mini_batches import resolve_mini_batch_schedule
from stacx.trainer.config.recipe import TRAINING_CONFIGS, TrainingConfig
from stacx.trainer.config.run import AlgorithmConfig, ConfigError, RunConfig, is_flux_style_section

CLIP_BOUNDS = ("clip_ratio_low", "clip_ratio_high")
ESTIMATOR_ALIASES = ("adv_estimator",)
"""Other frameworks' names for `advantage_estimator` (guide 001's `adv_estimator`), accepted as it."""


def flux_style_name(run_config: RunConfig) -> str | None:
    """`algorithm.name` of a Flux-style `algorithm:` section (one with `adv_estimator`), else None. (Only
    such a section holds a `name`, as a custom key: elsewhere `RunConfig.from_dict` refuses it.)"""
    algorithm = run_config.algorithm
    name = algorithm.extras.get("name")
    if name and is_flux_style_section(algorithm.given_keys):
        return str(name)
    return None


def policy_loss_named_by_algorithm(run_config: RunConfig) -> str | None:
    """The policy loss `algorithm.name` selects, or None.

    In a Flux-style `algorithm:` section (it sets `adv_estimator`) `name` is the policy loss, as in
    Flux, even where it also names a recipe (`ppo`, `gspo`, `cispo`; see `flux_name_also_a_recipe`):
    the recipe is then --algorithm / train.algorithm, or the one its estimator infers. A name there
    that is a recipe and no policy loss (`grpo`) stays the recipe. Elsewhere (guide 001), a name that
    is a registered policy loss and not a recipe selects that loss. Raises ValueError for a
    Flux-style name that is neither, suggesting the closest policy loss."""
    flux_name = flux_style_name(run_config)
    if flux_name is not None:
        if flux_name in POLICY_LOSSES:
            return flux_name
        if flux_name in TRAINING_CONFIGS:
            return None
        close = difflib.get_close_matches(flux_name, POLICY_LOSSES.names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"algorithm.name {flux_name!r}: in a Flux-style algorithm section (it sets adv_estimator) name is the "
            f"policy loss, and no policy loss {flux_name!r} is registered; {hint}registered policy losses: "
            f"{', '.join(POLICY_LOSSES.names())} (load a custom one with --custom-module)")
    name = run_config.train.algorithm
    if name and name not in TRAINING_CONFIGS and name in POLICY_LOSSES:
        return name
    return None


def recipe_named_by_config(run_config: RunConfig) -> str | None:
    """The recipe the config names (--algorithm = train.algorithm, a Flux-style recipe-only name), or
    None when the estimator (or use_critic) picks it (`infer_algorithm`)."""
    flux_name = flux_style_name(run_config)
    if flux_name is not None:
        named_loss = policy_loss_named_by_algorithm(run_config)
        return run_config.train.algorithm or (None if named_loss else flux_name)
    return None if policy_loss_named_by_algorithm(run_config) else run_config.train.algorithm


def flux_name_also_a_recipe(run_config: RunConfig) -> str | None:
    """A warning when a Flux-style `algorithm.name` selects a policy loss that is also a recipe's name."""
    flux_name = flux_style_name(run_config)
    if flux_name is None or flux_name not in TRAINING_CONFIGS or policy_loss_named_by_algorithm(run_config) is None:
        return None
    return (f"algorithm.name {flux_name!r} is taken as the policy loss {flux_name!r}, as in Flux (the algorithm "
            f"section sets adv_estimator), not as the recipe {flux_name!r}; the recipe is "
            f"{run_config.train.algorithm!r} (--algorithm)" if run_config.train.algorithm else
            f"algorithm.name {flux_name!r} is taken as the policy loss {flux_name!r}, as in Flux (the algorithm "
            f"section sets adv_estimator), not as the recipe {flux_name!r}; the recipe follows the advantage "
            f"estimator. To run the recipe {flux_name!r}, pass --algorithm {flux_name} (or set train.algorithm)")


def user_algorithm_values(run_config: RunConfig) -> dict[str, Any]:
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
    if named_loss is not None and given.setdefault("policy_loss", named_loss) != named_loss:
        raise ValueError(f"algorithm.name {named_loss!r} names a policy loss but algorithm.policy_loss is "
                         f"{given['policy_loss']!r}; set only one of them")
    given.pop("name", None)  # a Flux-style name: the policy loss above, or the recipe (recipe_named_by_config)
    return given


def apply_run_env_overrides(run_config: RunConfig, environ=None):
    """The run config with the `STACX_*` overrides (stacx.env_overrides) applied to its
    teacher section, read ONCE, in the process that resolves the run (the Ray driver, or each
    torchrun rank), and recorded in `given_keys` (an override is a user setting). Everything
    downstream (the driver's teacher top-K request, the roll-in, the workers, which receive this
    object) sees the same values; workers never read their own env."""
    teacher = apply_env_overrides(run_config.teacher, environ)
    if teacher is run_config.teacher:
        return run_config
    given_keys = run_config.given_keys | frozenset(read_env_overrides(environ))
    return dataclasses.replace(run_config, teacher=teacher, given_keys=given_keys)


def resolve_algorithm_config(training_config: TrainingConfig, run_config: RunConfig, environ=None) -> AlgorithmConfig:
    """The one AlgorithmConfig of a run, every rank's and every checkpoint's. Layers, lowest first:
    the declared defaults < the recipe's overrides < the config file < flags < STACX_* overrides
    (file and flags are already merged, flags over file, in `run_config`). The recipe it belongs
    to is `training_config.name` (train.algorithm), not a field of it.
    Its `given_keys` are the keys the user set (file, flags, env), recorded, never guessed."""
    run_config = apply_run_env_overrides(run_config, environ)
    values = training_config.algorithm.to_dict() if training_config.algorithm else {}
    # Settings of other sections the specializations read as config.<name> (the sampling temperature
    # of training log-probs, the distillation mode): the user's section value (file, flag, env)
    # overrides the recipe's; an unset one leaves the recipe's (or the declared default, the same
    # as the section's) in place.
    sections = {"rollout_temperature": run_config.rollout, "distill_kl_mode": run_config.teacher,
                "teacher_top_k": run_config.teacher}
    given_keys = set()
    for key, section in sections.items():
        if key in run_config.given_keys or key not in values:
            values[key] = getattr(section, key)
            given_keys |= {key} & run_config.given_keys
    user_values = user_algorithm_values(run_config)
    values.update(user_values)
    given_keys |= set(user_values)
    if "distill_kl_mode" in read_env_overrides(environ):  # STACX_* wins over file and flags
        values["distill_kl_mode"] = run_config.teacher.distill_kl_mode
        given_keys.add("distill_kl_mode")
    values.update(proximal_policy_values(training_config, run_config, user_values))
    # given_keys = what the USER set: plugin adapters pass a hyperparameter only when it was set, so a
    # plugin's own default is not overwritten by ours.
    return AlgorithmConfig.from_values(values, given_keys=given_keys)


def proximal_policy_values(training_config: TrainingConfig, run_config: RunConfig,
                           user_values: dict[str, Any]) -> dict[str, Any]:
    """`recompute_old_log_probs: True` when a rollout feeds several optimizer steps: pi_old is then the
    policy before the rollout's first update, computed once (without it each mini-batch's pi_old would
    be its own detached forward, the ratio 1 and every clip inert). An explicit False is refused."""
    schedule = resolve_mini_batch_schedule(run_config.rollout, run_config.train, data_source=training_config.data_source)
    if runs_off_policy_rollouts(run_config.rollout) and training_config.data_source == "rollout":
        return decoupled_objective_values(run_config.rollout, user_values,
                                          optimizer_steps_per_rollout=schedule.optimizer_steps_per_rollout)
    if schedule.optimizer_steps_per_rollout == 1:
        return {}
    if user_values.get("recompute_old_log_probs") is False:
        raise ConfigError(
            f"--no-recompute-old-log-probs with {schedule.optimizer_steps_per_rollout} optimizer steps per rollout "
            f"(--num-steps-per-rollout {schedule.num_steps_per_rollout} x --num-epochs {schedule.num_epochs}): "
            "pi_old would be each mini-batch's own detached forward, so the importance ratio stays 1 and the clip "
            "never acts; drop --no-recompute-old-log-probs (pi_old is then computed once per rollout, before the "
            "first update) or train one optimizer step per rollout")
    return {"recompute_old_log_probs": True}


def runs_off_policy_rollouts(rollout) -> bool:
    """--rollout-mode async with --max-staleness >= 1 or --partial-rollout: a batch may hold tokens of
    older policy versions. (Async with K = 0 and no partial rollout is the synchronous schedule and
    resolves exactly like a sync run.)"""
    return rollout.rollout_mode == "async" and (rollout.max_staleness >= 1 or rollout.partial_rollout)


ASYNC_DEFAULT_CORRECTION = "token_tis"
"""The off-policy correction asynchronous runs get unless --off-policy-corrections is given."""


def decoupled_objective_values(rollout, user_values: dict[str, Any], *,
                               optimizer_steps_per_rollout: int = 1) -> dict[str, Any]:
    """The decoupled objective of an off-policy (async) run: pi_old is the trainer's own policy before the
    step (the proximal policy, in the clip), and the engine's per-token log-probs (the behaviour policy)
    weigh each token by min(pi_prox / pi_behav, C) (`token_tis`) unless the user chose corrections.

    With one optimizer step per rollout pi_prox is the weights the step's own forward runs with, so the
    training forward's detached log-probs are pi_prox exactly and no extra forward is spent on it
    (`recompute_old_log_probs` stays as resolved). With several, pi_old is recomputed once before the
    first update, and an explicit --no-recompute-old-log-probs is refused: the clip would be centred on
    the behaviour policy of a stale version."""
    values: dict[str, Any] = {}
    if "off_policy_corrections" not in user_values:
        values["off_policy_corrections"] = ASYNC_DEFAULT_CORRECTION
    if optimizer_steps_per_rollout == 1:
        return values
    if user_values.get("recompute_old_log_probs") is False:
        raise ConfigError(
            f"--no-recompute-old-log-probs with --rollout-mode async --max-staleness {rollout.max_staleness}"
            f"{' --partial-rollout' if rollout.partial_rollout else ''}: samples come from older policy versions, "
            "so pi_old must be the trainer's own (proximal) policy, recomputed before the step; drop "
            "--no-recompute-old-log-probs (the engine's log-probs stay the behaviour policy of the off-policy "
            "correction)")
    return {**values, "recompute_old_log_probs": True}


def resolved_run_config_dict(run_config: RunConfig, algorithm: AlgorithmConfig, *,
                             recipe: str | None = None) -> dict[str, Any]:
    """The run config as saved with checkpoints: every section, the algorithm as trained and, given
    `recipe`, the recipe it resolved to as train.algorithm (a resumed run then names it explicitly)."""
    out = run_config.to_dict()
    out["algorithm"] = algorithm.to_dict()
    if recipe is not None:
        out["train"]["algorithm"] = recipe
    return out


def current_run_config_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run_config.json in today's keys. Runs saved while the recipe had two fields also carry it
    as algorithm.name (the resolved recipe); it moves to train.algorithm, its one field now (a value
    already there wins: it is what that run was launched with)."""
    algorithm = saved.get("algorithm")
    if not isinstance(algorithm, dict) or "name" not in algorithm or is_flux_style_section(algorithm):
        return saved
    algorithm = dict(algorithm)
    name = algorithm.pop("name")
    train = dict(saved.get("train") or {})
    if not train.get("algorithm"):
        train["algorithm"] = name
    return {**saved, "train": train, "algorithm": algorithm}


def check_resumed_algorithm(saved_run_config: dict[str, Any], algorithm: AlgorithmConfig, *, where: str) -> None:
    """Refuse to resume a checkpoint (`where`) whose saved algorithm hyperparameters differ from the
    ones this run resolved: the optimizer state and the advantages so far belong to the saved ones.
    The message names every changed key with both values. Keys the saved run did not record (a field
    added since) are not compared."""
    saved = current_run_config_keys(saved_run_config).get("algorithm") or {}
    current = algorithm.to_dict()
    changed = [f"{key}: saved {saved[key]!r}, now {current.get(key)!r}"
               for key in sorted(saved) if key in current and _differs(saved[key], current[key])]
    changed += [f"{key}: saved {saved[key]!r}, now unset" for key in sorted(set(saved) - set(current))]
    if changed:
        raise ValueError(f"checkpoint {where} was trained with other algorithm settings ({'; '.join(changed)}); "
                         "resume with the settings it was saved with (its run_config.json), or start a fresh run")


def _differs(saved: Any, current: Any) -> bool:
    # JSON turned tuples into lists and ints that were floats may read back as ints.
    if isinstance(saved, (int, float)) and isinstance(current, (int, float)) and not isinstance(saved, bool):
        return float(saved) != float(current)
    if isinstance(saved, list) and isinstance(current, (list, tuple)):
        return list(saved) != list(current)
    return saved != current
