"""GRPO from a model that never earns a reward trains at loss 0: the driver says so once, with the
step and what to change, instead of running silently."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from stacx.rollout.step_rollout import StepRollout, uniform_reward_warning


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


def test_one_informative_group_is_enough_to_stay_quiet():
    assert _warning([[0.0, 0.0], [0.0, 1.0]]) is None
    assert _warning([]) is None


def _step_rollout(estimator: str, uses_reward: bool = True) -> StepRollout:
    step_rollout = StepRollout.__new__(StepRollout)  # only what the warning reads
    step_rollout.warned_uniform_rewards = False
    step_rollout.training_config = SimpleNamespace(uses_reward=uses_reward)
    step_rollout.algorithm = SimpleNamespace(advantage_estimator=estimator)
    step_rollout.run_config = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2, rollout_temperature=1.0,
                                                                      reward_fn="exact_match"))
    return step_rollout


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
        _step_rollout("gae").warn_if_rewards_are_uniform(0, _samples([[0.0, 0.0]]))  # the critic's values
        _step_rollout("grpo", uses_reward=False).warn_if_rewards_are_uniform(0, _samples([[0.0, 0.0]]))
    assert not [r for r in caplog.records if "identical" in r.getMessage()]
