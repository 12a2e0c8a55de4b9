"""The rollout's view of a run: its `RolloutPlan`, built from the recipe and the run config.

    plan = rollout_plan(training_config, run_config)     # ValueError naming the field for a bad roll-in
    service = RolloutService.start(run_config.rollout, run_config.teacher, plan=plan, hf_checkpoint=...)
"""

from __future__ import annotations

from typing import Mapping, Optional

from stacx.rollout.plan import RolloutPlan
from stacx.rollout.rollin import resolve_rollin
from stacx.trainer.config.recipe import TrainingConfig
from stacx.trainer.config.run import RunConfig


def rollout_plan(training_config: TrainingConfig, run_config: RunConfig,
                 environ: Optional[Mapping[str, str]] = None) -> RolloutPlan:
    """The plan of a run of `training_config`; its roll-in is resolved now (STACX_* overrides from
    `environ`, default the process environment), so a bad mode or schedule fails before any worker starts."""
    rollin = resolve_rollin(training_config.rollin_protocol, run_config.teacher, environ,
                            given_keys=run_config.given_keys, recipe=training_config.name)
    return RolloutPlan(recipe=training_config.name, data_source=training_config.data_source,
                       uses_teacher=training_config.uses_teacher, uses_reward=training_config.uses_reward,
                       rollin_protocol=training_config.rollin_protocol, rollin=rollin)
