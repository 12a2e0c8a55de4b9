"""The rollout's plan of a run, built by the trainer: the recipe's traits, and roll-in settings
checked before any worker starts."""

from __future__ import annotations

import pytest

from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.recipes import get_recipe


def test_a_plan_carries_what_the_rollout_reads_of_the_recipe():
    plan = rollout_plan(get_recipe("mixture_dagger_opd"), RunConfig(), environ={})
    assert (plan.recipe, plan.data_source, plan.uses_teacher, plan.rollin_protocol) == (
        "mixture_dagger_opd", "rollout", True, "beta_mixture")
    assert plan.samples_rollouts and plan.rollin.mode == "beta"
    grpo = rollout_plan(get_recipe("grpo"), RunConfig(), environ={})
    assert grpo.uses_reward and not grpo.uses_teacher and grpo.rollin.mode == "student"
    sft = rollout_plan(get_recipe("sft"), RunConfig(), environ={})
    assert not sft.samples_rollouts and sft.rollin.mode == "student"
    replay = RunConfig.from_dict({"dagger_sft_mode": "trajectory"})
    assert rollout_plan(get_recipe("online_dagger"), replay, environ={}).rollin is None
    # A dagger_sampling_mode the user set wins over the recipe's protocol.
    assert rollout_plan(get_recipe("mixture_dagger_opd"), RunConfig.from_dict({"dagger_sampling_mode": "kappa"}),
                        environ={}).rollin.mode == "kappa"


def test_bad_rollin_settings_are_refused_before_any_worker_starts():
    # Live roll-ins run (tests/trainer/test_loop_rollout_dagger.py); a bad schedule or mode fails at start.
    rollout_plan(get_recipe("online_dagger"), RunConfig())
    with pytest.raises(ValueError, match="dagger_beta_start"):
        rollout_plan(get_recipe("mixture_dagger_opd"), RunConfig.from_dict({"dagger_beta_start": 1.5}))
    with pytest.raises(ValueError, match="dagger_sampling_mode"):
        rollout_plan(get_recipe("mixture_aggrevate_opd"), RunConfig.from_dict({"dagger_sampling_mode": "gamma"}))
