"""`StacxTrainer` built from fakes of its `RoleGroup`s and rollout service: failure paths of the loop."""

from __future__ import annotations

import pytest

from stacx.rollout.service import RolloutService
from stacx.trainer.config.run import RunConfig
from tests.trainer.fakes import FakeRoleGroup, make_trainer


class RecordingEngine:
    """The engine half of the weight-update handshake, recording each step."""

    def __init__(self):
        self.calls = []

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def flush_cache(self):
        self.calls.append("flush")

    def weight_version(self):
        return 0  # never reached: the version check is skipped after a failed push


def test_a_failed_weight_push_reports_its_own_error_and_resumes_the_engine():
    """The push's error propagates (not a stale-version error from the version check), and the
    engine is resumed without checking a version it never received."""
    engine = RecordingEngine()
    service = RolloutService(engine, engine_kind="http", url="http://engine", tokenizer=None,
                             rollout_section=RunConfig().rollout)
    policy = FakeRoleGroup("policy", fail_on="push_weights", error=RuntimeError("policy rank 1 died while pushing bucket 3"))
    trainer = make_trainer("grpo", roles={"policy": policy}, rollout=service)
    with pytest.raises(RuntimeError, match="died while pushing bucket 3"):
        trainer.push_policy_weights(version=4)
    assert engine.calls == ["pause", "resume"]
    assert policy.calls == ["push_weights"]


class BrokenRolloutService(RolloutService):
    """A rollout service whose close fails (its engine's socket is already gone)."""

    def close(self):
        raise OSError("engine socket already gone")


def test_teardown_errors_never_hide_the_runs_error_and_workers_are_always_released():
    released = []
    run_config = RunConfig.from_dict({"num_steps": 1})

    def trainer_with(**groups):
        return make_trainer("sft", roles={"policy": FakeRoleGroup("policy", **groups)}, run_config=run_config,
                            rollout=BrokenRolloutService(RecordingEngine(), engine_kind="http", url="http://engine", tokenizer=None,
                                                         rollout_section=run_config.rollout), on_failure=lambda: released.append("killed"),
                            on_close=lambda: released.append("shut down"))

    trainer = trainer_with()
    trainer.train_one_step = lambda step: (_ for _ in ()).throw(RuntimeError("role 'actor' rank 0 failed"))
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        trainer.run()
    assert released == ["killed"]
    released.clear()
    trainer = trainer_with()
    trainer.train_one_step = lambda step: {}
    trainer.engine_target = None  # nothing to push to: the fake engine is only there to fail its close
    with pytest.raises(OSError, match="socket already gone"):
        trainer.run()
    assert released == ["shut down"]  # the workers went down although the engine's close failed


def test_the_trainer_and_the_async_check_refuse_an_algorithm_config_of_another_type():
    """The estimator and the driver's rollout read `algorithm.<knob>`: a look-alike object is refused when
    the trainer (or the async check) receives it, naming the receiver and the fix."""
    from types import SimpleNamespace

    from stacx.rollout.asynchronous.async_rollout import check_async_supported
    from stacx.trainer.config.rollout_plan import rollout_plan
    from stacx.trainer.loop import StacxTrainer
    from stacx.trainer.recipes import get_recipe

    look_alike = SimpleNamespace(advantage_estimator="grpo", filter_zero_variance_groups=False)
    fix = r"needs a stacx.objectives.algorithm_config.AlgorithmConfig .*got SimpleNamespace"
    with pytest.raises(TypeError, match=r"StacxTrainer\(algorithm=...\) " + fix):
        StacxTrainer(run_config=RunConfig(), training_config=get_recipe("grpo"), algorithm=look_alike, roles={},
                     channel=None, data=None)
    with pytest.raises(TypeError, match=r"check_async_supported " + fix):
        config = RunConfig.from_dict({"rollout_mode": "async"})
        check_async_supported(config.rollout, rollout_plan(get_recipe("grpo"), config), look_alike)
