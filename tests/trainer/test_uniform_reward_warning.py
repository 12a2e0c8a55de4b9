"""GRPO from a model that never earns a reward trains at loss 0: the driver says so once, with the
step and what to change, instead of running silently."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from stacx.rollout.service import RolloutService
from stacx.rollout.step_rollout import StepRollout, uniform_reward_warning
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.trainer.config.run import RunConfig
from stacx.trainer.recipes import get_recipe
from stacx.trainer.config.rollout_plan import rollout_plan


def _samples(rewards_per_group: list[list[float]]) -> list:
    return [SimpleNamespace(group_index=g, reward=r) for g, group in enumerate(rewards_per_group) for r in group]


def _warning(rewards_per_group):
    return uniform_reward_warning(3, _samples(rewards_per_group), n_samples_per_prompt=2, temperature=1.0,
                                  reward_fn="exact_match")


def test_identical_rewards_in_every_group_are_named_with_step_and_fixes():
    message = _warning([[0.0, 0.0], [0.0, 0.0]])
    assert message is not None and "step 3" in message and "every advantage and the policy loss are 0" in message
    for fix in ("SFT", "--n-samples-per-prompt, now 2", "--rollout-temperature, now 1", "--reward-fn exact_match"):
        assert fix in message, fix
    assert "reward 0, 1 within each of 2 groups" in _warning([[0.0, 0.0], [1.0, 1.0]])  # equal within, not across
    assert "reward 0 within" in _warning([[None, 0.0]])  # a missing reward counts as 0, like the loss sees it


def test_environment_episodes_point_at_the_environment_not_the_reward_function():
    episodes = [SimpleNamespace(group_index=0, reward=0.0, metadata={"environment": "swe", "episode": {}})] * 2
    message = uniform_reward_warning(3, episodes, n_samples_per_prompt=2, temperature=1.0, reward_fn="exact_match")
    assert "check what swe rewards" in message and "agent/parse_errors" in message and "--reward-fn" not in message


def test_one_informative_group_is_enough_to_stay_quiet():
    assert _warning([[0.0, 0.0], [0.0, 1.0]]) is None
    assert _warning([]) is None


def _step_rollout(recipe: str) -> StepRollout:
    """The driver's StepRollout of a built-in recipe, over a service whose engine is never called."""
    run_config = RunConfig.from_dict({"n_samples_per_prompt": 2, "rollout_temperature": 1.0,
                                      "reward_fn": "exact_match"})
    training_config = get_recipe(recipe)
    service = RolloutService(None, engine_kind="http", url="http://engine", tokenizer=None,
                             rollout_section=run_config.rollout)
    return StepRollout(service, None, rollout=run_config.rollout, plan=rollout_plan(training_config, run_config),
                       out_dir=run_config.logging.out,
                       algorithm=resolve_algorithm_config(training_config, run_config, environ={}))


def test_the_driver_warns_once_per_run(caplog):
    step_rollout = _step_rollout("grpo")
    with caplog.at_level(logging.WARNING, logger="stacx.rollout.step_rollout"):
        step_rollout.warn_if_rewards_are_uniform(0, _samples([[0.0, 1.0]]))
        step_rollout.warn_if_rewards_are_uniform(1, _samples([[0.0, 0.0]]))
        step_rollout.warn_if_rewards_are_uniform(2, _samples([[0.0, 0.0]]))
    warnings = [r.getMessage() for r in caplog.records if "identical" in r.getMessage()]
    assert len(warnings) == 1 and "step 1:" in warnings[0]


def test_no_warning_where_uniform_rewards_do_not_zero_the_loss(caplog):
    with caplog.at_level(logging.WARNING, logger="stacx.rollout.step_rollout"):
        _step_rollout("ppo").warn_if_rewards_are_uniform(0, _samples([[0.0, 0.0]]))  # gae: the critic's values
        _step_rollout("opd").warn_if_rewards_are_uniform(0, _samples([[0.0, 0.0]]))  # no reward in the loss
    assert not [r for r in caplog.records if "identical" in r.getMessage()]
