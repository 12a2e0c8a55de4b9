"""The algorithm hyperparameters a run trains with: the recipe's defaults under the user's settings.

`RunConfig.algorithm` holds every known field with its generic default (ALGORITHM_FIELDS) plus
custom keys. A value the user left at the generic default yields to the recipe's default
(grpo's clip ratios, ppo's lam, ...); a value that differs from it, and every custom key, wins.
"""

from __future__ import annotations

from typing import Any

from stacx.trainer.run_config import ALGORITHM_FIELDS, AlgorithmConfig


def resolve_algorithm_config(training_config, run_config) -> AlgorithmConfig:
    """AlgorithmConfig = recipe defaults, run-section settings the kernels read, then the user's
    non-default values; `name` = the recipe."""
    user = run_config.algorithm.to_dict()
    clip = user.get("clip_ratio", ALGORITHM_FIELDS["clip_ratio"])
    chosen: dict[str, Any] = {}
    for key, value in user.items():
        if key not in ALGORITHM_FIELDS:
            chosen[key] = value
        elif key in ("clip_ratio_low", "clip_ratio_high"):
            # AlgorithmConfig fills unset clip bounds from clip_ratio; only a bound that differs, or a changed
            # clip_ratio, is the user's choice.
            if value != clip or clip != ALGORITHM_FIELDS["clip_ratio"]:
                chosen[key] = value
        elif value != ALGORITHM_FIELDS[key]:
            chosen[key] = value
    values = training_config.algorithm.as_algorithm_values(training_config.name) if training_config.algorithm else {}
    # Settings of other sections the specializations read as config.<name> (the sampling temperature
    # of training log-probs, the distillation mode), unless the algorithm section sets them itself.
    values.update(rollout_temperature=run_config.rollout.rollout_temperature,
                  distill_kl_mode=run_config.teacher.distill_kl_mode, teacher_top_k=run_config.teacher.teacher_top_k)
    values.update(chosen)
    values["name"] = training_config.name
    return AlgorithmConfig(**values)


def resolved_run_config_dict(run_config, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """The run config as saved with checkpoints: every section, the algorithm as trained."""
    out = run_config.to_dict()
    out["algorithm"] = algorithm.to_dict()
    return out
