"""The loop's one sample source: chosen once from the recipe and the run config, and the only thing the
loop asks for batches, version hooks and the driver state of a checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stacx.rollout.step_rollout import StepRollout
from stacx.trainer.batch import StepBatch
from stacx.trainer.config.run import RunConfig
from stacx.trainer.recipes import get_recipe
from stacx.trainer.sample_sources import (AsyncRolloutSamples, DatasetSamples, NoSamples, RolloutSamples,
                                          choose_sample_source)
from stacx.trainer.checkpoint import write_rank_state
from tests.trainer.fakes import FakeDataSource, FakeRoleGroup, make_trainer

SERVICE = SimpleNamespace(engine_kind="cpu", urls=("scripted",), api_key=None, url="scripted", tokenizer=None)
"""What the trainer reads of a rollout service before a run starts (a StepRollout asks it nothing then)."""


def _batch() -> StepBatch:
    return StepBatch.supervised([[1, 2]], [[3, 4]])


def test_the_trainer_chooses_its_sample_source_once_from_the_recipe_and_the_run_config():
    sft = make_trainer("sft", data=FakeDataSource(_batch()))
    assert type(sft.samples) is DatasetSamples and sft.samples.phase == "batch" and sft.step_rollout is None
    sync = make_trainer("grpo", rollout=SERVICE, data=FakeDataSource(_batch()))
    assert type(sync.samples) is RolloutSamples and isinstance(sync.step_rollout, StepRollout)
    asynchronous = make_trainer("grpo", rollout=SERVICE, data=FakeDataSource(_batch()),
                                run_config=RunConfig.from_dict({"rollout_mode": "async"}))
    assert type(asynchronous.samples) is AsyncRolloutSamples and asynchronous.async_rollout is None  # until `run`
    assert sync.async_rollout is None and sync.samples.waiting_for is None
    recipe, run_config = get_recipe("grpo"), RunConfig.from_dict({"rollout_mode": "async"})
    algorithm = asynchronous.algorithm
    with pytest.raises(ValueError, match="--rollout-mode async draws its own prompts"):
        choose_sample_source(run_config=run_config, training_config=recipe, algorithm=algorithm, data=None,
                             rollout=SERVICE, is_driver=True, step_rollout=SimpleNamespace())
    follower = choose_sample_source(run_config=run_config, training_config=recipe, algorithm=algorithm, data=None,
                                    rollout=SERVICE, is_driver=False)
    assert type(follower) is NoSamples and follower.state_dict() == {}
    batch = _batch()
    batch.log_probs, batch.rollout_log_probs = [torch.zeros(2)], [torch.zeros(2)]
    # A rank that is not the driver of an async run reports the same importance weights as the driver.
    assert follower.trained_batch_metrics(batch)["async/iw_mean"] == 1.0
    assert NoSamples().trained_batch_metrics(batch) == {}


class RecordingSource(DatasetSamples):
    """A dataset source that records the hooks the loop calls, and saves and restores a position."""

    def __init__(self, calls: list):
        super().__init__(FakeDataSource(_batch()))
        self.calls = calls
        self.position = 0

    def start(self, version):
        self.calls.append(("start", version))

    def collect(self, step):
        self.calls.append(("collect", step))
        self.position += 1
        return super().collect(step)

    def state_dict(self):
        return {"data": {"position": self.position}, "async": {"groups": self.position}}

    def load_state_dict(self, driver_state):
        self.calls.append(("load", driver_state["data"], driver_state["async"]))

    def close(self):
        self.calls.append(("close",))


class SavingPolicy(FakeRoleGroup):
    def save(self, staging_dir):
        return [write_rank_state(staging_dir, "policy", 0, {})]


def test_the_loop_takes_batches_and_checkpoint_state_from_its_source_and_resumes_it(tmp_path):
    save = str(tmp_path / "ckpt")
    calls = []
    trainer = make_trainer("sft", roles={"policy": SavingPolicy("policy")},
                           run_config=RunConfig.from_dict({"num_steps": 2, "save": save}))
    trainer.samples = RecordingSource(calls)
    trainer.run()
    assert calls == [("start", 0), ("collect", 0), ("collect", 1), ("close",)]
    resumed_calls = []
    resumed = make_trainer("sft", roles={"policy": SavingPolicy("policy")},
                           run_config=RunConfig.from_dict({"num_steps": 3, "save": save, "load": save}))
    resumed.samples = RecordingSource(resumed_calls)
    resumed.run()
    assert resumed_calls == [("load", {"position": 2}, {"groups": 2}), ("start", 2), ("collect", 2), ("close",)]
