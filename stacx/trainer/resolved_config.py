"""The algorithm hyperparameters a run trains with: the recipe's defaults under the user's settings.

Precedence, lowest first:
    generic defaults (ALGORITHM_FIELDS)
    < the recipe's AlgorithmDefaults (grpo's clip ratios, ppo's lam, ...)
    < settings of other sections the kernels read (rollout_temperature, distill_kl_mode, teacher_top_k)
    < every key the user set (`RunConfig.algorithm.given_keys`), custom keys included.

"Set" means given, not "different from the generic default": `lam: 1.0` under ppo stays 1.0.
A user `clip_ratio` without explicit bounds sets both clip bounds (it is the more specific choice
than the recipe's default bounds).
"""

from __future__ import annotations

from typing import Any

from stacx.trainer.run_config import AlgorithmConfig

CLIP_BOUNDS = ("clip_ratio_low", "clip_ratio_high")


def user_algorithm_values(run_config) -> dict[str, Any]:
    """The algorithm keys the user set, with a given clip_ratio expanded into unset clip bounds."""
    given = run_config.algorithm.given_values()
    if "clip_ratio" in given:
        for bound in CLIP_BOUNDS:
            given.setdefault(bound, given["clip_ratio"])
    return given


def resolve_algorithm_config(training_config, run_config) -> AlgorithmConfig:
    """AlgorithmConfig = recipe defaults, run-section settings the kernels read, then every key the
    user set; `name` = the recipe."""
    values = training_config.algorithm.as_algorithm_values(training_config.name) if training_config.algorithm else {}
    # Settings of other sections the specializations read as config.<name> (the sampling temperature
    # of training log-probs, the distillation mode), unless the algorithm section sets them itself.
    values.update(rollout_temperature=run_config.rollout.rollout_temperature,
                  distill_kl_mode=run_config.teacher.distill_kl_mode, teacher_top_k=run_config.teacher.teacher_top_k)
    values.update(user_algorithm_values(run_config))
    values["name"] = training_config.name
    return AlgorithmConfig(**values)


def resolved_run_config_dict(run_config, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """The run config as saved with checkpoints: every section, the algorithm as trained."""
    out = run_config.to_dict()
    out["algorithm"] = algorithm.to_dict()
    return out
