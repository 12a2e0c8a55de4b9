"""--max-restarts and --dump-rollouts / --replay-rollouts on a `StacxTrainer` built from fakes (no ranks, no
engine): which failures restart and from which checkpoint, the `run/restarts` count, the torchrun side
(checkpoint found by the restarted rank, the --save lock taken again, torchrun's own --max-restarts), and a
dump's step files read back as the same batches the trainer trained on. The end-to-end runs are in
test_restarts_end_to_end.py and test_rollout_replay.py."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time

import pytest
import torch

from stacx.trainer.batch import StepBatch
from stacx.trainer.cluster.ray.health import RoleWorkerDied, RoleWorkerRaised, RoleWorkerTimeout
from stacx.trainer.config.run import RunConfig
from stacx.trainer.restarts import (
    RESTARTS_METRIC,
    ResumePoint,
    elastic_restart_config,
    is_restartable,
    run_with_restarts,
)
from stacx.trainer.rollout_dump import (
    MANIFEST_NAME,
    RolloutDumpError,
    RolloutDumpWriter,
    RolloutReplay,
    step_file_name,
)
from tests.trainer.fakes import FakeDataSource, FakeRoleGroup, make_trainer
from tests.trainer.save_lock_holder import hold_the_save_lock_until_released


def _batch(offset: int = 0) -> StepBatch:
    batch = StepBatch.supervised([[1 + offset, 2], [3, 4, 5]], [[6, 7], [8]])
    batch.rollout_log_probs = [torch.tensor([-0.5, -1.25]), torch.tensor([-2.0])]
    batch.rewards = [1.0, 0.0]
    batch.prompt_id = [0, 0]
    batch.executors = [torch.tensor([1, 1]), torch.tensor([1])]
    batch.routed_experts = [torch.zeros(3, 2, 1, dtype=torch.int32), torch.ones(3, 2, 1, dtype=torch.int32)]
    batch.teacher_top_ids = [torch.tensor([[3, 4], [5, 6]]), torch.tensor([[1, 2]])]
    batch.teacher_top_log_probs = [torch.tensor([[-0.1, -2.0], [-0.3, -1.0]]), torch.tensor([[-0.7, -0.9]])]
    return batch


class BatchesSeen(FakeRoleGroup):
    """Records every shard it trains on; raises `error` at train step `fail_at` (counted from 1), once."""

    def __init__(self, name: str, *, fail_at: int | None = None, error: BaseException | None = None):
        super().__init__(name)
        self.shards: list[StepBatch] = []
        self.fail_at, self.failure = fail_at, error

    def train_step(self, shards, counts, norm_length):
        self.shards.append(shards[0][0])
        if self.fail_at is not None and len(self.shards) == self.fail_at:
            raise self.failure
        return [{"loss": float(len(self.shards))}]

    def save(self, staging_dir) -> list:
        from stacx.trainer.checkpoint import write_rank_state

        self.calls.append("save")
        return [write_rank_state(staging_dir, self.name, 0, {"trained": len(self.shards)})]


def _same_batch(a: StepBatch, b: StepBatch) -> None:
    for field in dataclasses.fields(StepBatch):
        left, right = getattr(a, field.name), getattr(b, field.name)
        assert (left is None) == (right is None), field.name
        if left is not None:
            assert len(left) == len(right), field.name
            for x, y in zip(left, right):
                assert (x.dtype == y.dtype and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y, field.name


# ---- dump and replay ---------------------------------------------------------------------------


def test_a_dump_replays_the_batches_the_trainer_trained_on(tmp_path):
    dump = str(tmp_path / "dump")
    batches = iter([_batch(0), _batch(1)])

    class TwoBatches(FakeDataSource):
        def next_dataset_batch(self):
            return next(batches)

    original = BatchesSeen("policy")
    cfg = RunConfig.from_dict({"num_steps": 2, "dump_rollouts": dump, "progress_bar": False})
    last = make_trainer("sft", roles={"policy": original}, run_config=cfg, data=TwoBatches(None)).run()
    assert last["rollout_dump/bytes"] == os.path.getsize(os.path.join(dump, step_file_name(1)))
    assert last["time/rollout_dump_s"] > 0
    assert sorted(os.listdir(dump)) == [MANIFEST_NAME, step_file_name(0), step_file_name(1)]  # no temporary left

    replayed = BatchesSeen("policy")
    cfg = RunConfig.from_dict({"num_steps": 2, "replay_rollouts": dump, "progress_bar": False})
    trainer = make_trainer("sft", roles={"policy": replayed}, run_config=cfg, data=None)  # no data, no engine
    trainer.run()
    assert len(replayed.shards) == 2
    for seen, again in zip(original.shards, replayed.shards):
        _same_batch(seen, again)
    assert replayed.shards[1].tokens[0].tolist() == [2, 2, 6, 7]


def test_a_step_file_holds_the_batch_without_the_trainers_fields_and_the_samples_versions(tmp_path):
    from stacx.rollout.manager import Sample

    batch = _batch()
    batch.advantages = [torch.ones(2), torch.ones(1)]  # the trainer's own: recomputed on replay, never dumped
    samples = [Sample(prompt_ids=[1, 2], response_ids=[6, 7], rollout_log_probs=[-0.5, -1.25], loss_mask=[1, 1],
                      executors=[1, 1], weight_version=3, metadata={"token_versions": [3, 4]}),
               Sample(prompt_ids=[3, 4, 5], response_ids=[8], rollout_log_probs=[-2.0], loss_mask=[1], executors=[1],
                      weight_version=4, finish_reason="stop")]
    writer = RolloutDumpWriter(tmp_path, recipe="grpo", seed=7)
    seconds, size = writer.write(5, batch, {"rollout/reward_mean": 0.5, "time/rollout_s": 3.0, "note": "text"}, samples)
    path = tmp_path / step_file_name(5)
    assert writer.bytes == size == path.stat().st_size > 0 and writer.seconds == seconds > 0
    payload = torch.load(path, weights_only=True)
    assert "advantages" not in payload["fields"]
    assert payload["fields"]["tokens"]["lengths"] == [4, 4] and payload["fields"]["rewards"] == [1.0, 0.0]
    assert payload["fields"]["routed_experts"]["packed"].shape == (6, 2, 1)  # one tensor per field, not per sample
    assert payload["samples"] == {"weight_version": [3, 4], "token_versions": [[3, 4], None],
                                  "finish_reason": ["length", "stop"]}
    read, metrics = RolloutReplay(tmp_path, recipe="grpo").read(5)
    assert read.advantages is None and metrics == {"rollout/reward_mean": 0.5}  # the original's timings left out
    batch.advantages = None
    _same_batch(batch, read)


def test_a_replay_names_a_missing_step_and_refuses_a_planted_pickle(tmp_path):
    RolloutDumpWriter(tmp_path, recipe="grpo", seed=0).write(0, _batch(), {})
    replay = RolloutReplay(tmp_path)
    with pytest.raises(RolloutDumpError, match=r"no step_000000001\.pt .*holds steps 0\.\.0.*--num-steps 1 or fewer"):
        replay.read(1)
    torch.save({"format": 1, "fields": {"tokens": [RunConfig()]}}, tmp_path / step_file_name(1))
    with pytest.raises(RolloutDumpError, match="may not be unpickled"):
        replay.read(1)
    with pytest.raises(RolloutDumpError, match="no dump.json there"):
        RolloutReplay(tmp_path / "elsewhere")


def test_preflight_refuses_restarts_without_save_and_a_replay_into_its_own_dump(tmp_path):
    from stacx.trainer.config.checks import PreflightError
    from stacx.trainer.preflight import check_restarts_and_dumps

    with pytest.raises(PreflightError, match="--max-restarts 2 .*give --save DIR"):
        check_restarts_and_dumps(RunConfig.from_dict({"max_restarts": 2}))
    with pytest.raises(PreflightError, match="--replay-rollouts .*no dump.json there"):
        check_restarts_and_dumps(RunConfig.from_dict({"replay_rollouts": str(tmp_path)}))
    RolloutDumpWriter(tmp_path, recipe="grpo", seed=0)
    with pytest.raises(PreflightError, match="name the same folder"):
        check_restarts_and_dumps(RunConfig.from_dict({"replay_rollouts": str(tmp_path), "dump_rollouts": str(tmp_path)}))
    check_restarts_and_dumps(RunConfig.from_dict({"replay_rollouts": str(tmp_path), "max_restarts": 1,
                                                  "save": str(tmp_path / "ckpt")}))


# ---- restarts on Ray (the driver's loop) -------------------------------------------------------


def test_a_dead_worker_restarts_the_run_from_the_newest_checkpoint_and_is_counted(tmp_path, capsys):
    """Generation 0 dies in rollout step 3 (after the step-2 checkpoint); generation 1 loads step 2 and ends."""
    save = str(tmp_path / "ckpt")
    cfg = RunConfig.from_dict({"num_steps": 4, "save": save, "save_interval": 2, "max_restarts": 1,
                               "progress_bar": False, "out": str(tmp_path / "out"), "tensorboard": False,
                               "plots": False})
    built: list = []

    def build(config):
        died = RoleWorkerDied("train_step: worker role 'actor' rank 0 died: SIGKILL", role_name="actor", rank=0)
        group = BatchesSeen("policy", fail_at=3 if not built else None, error=died)
        from stacx.trainer.factory import build_metrics_logger

        trainer = make_trainer("sft", roles={"policy": group}, run_config=config, data=FakeDataSource(_batch()))
        trainer.make_metrics_logger = lambda start: build_metrics_logger(config, "sft", start)
        built.append((config, trainer, group))
        return trainer

    last = run_with_restarts(cfg, build)
    assert len(built) == 2
    (first_cfg, _, _), (second_cfg, second, group) = built
    assert first_cfg.model.load is None and second_cfg.model.load == os.path.join(save, "step_000000002")
    assert "load" in group.calls and len(group.shards) == 2 and second.step == 4
    assert last[RESTARTS_METRIC] == 1.0
    err = capsys.readouterr().err
    assert "restart 1 of --max-restarts 1 from checkpoint" in err and "role 'actor' rank 0 died" in err
    from tests.trainer.training_fixtures import read_metrics

    rows = read_metrics(str(tmp_path / "out"))
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # the dead generation's rows after step 2 are gone
    assert [row[RESTARTS_METRIC] for row in rows] == [0.0, 0.0, 1.0, 1.0]


def test_errors_a_restart_cannot_cure_and_the_last_allowed_death_end_the_run(tmp_path):
    raised = RoleWorkerRaised("train_step: worker role 'actor' rank 0 raised: ValueError", role_name="actor", rank=0)
    died = RoleWorkerDied("worker died", role_name="actor", rank=0)
    assert is_restartable(died) and is_restartable(RoleWorkerTimeout("hung", role_name="actor", rank=0))
    assert not is_restartable(raised) and not is_restartable(ValueError("bad"))
    assert not is_restartable(RoleWorkerDied("worker died: the actor died because of an error raised in its "
                                             "creation task"))
    for error, max_restarts, builds in ((raised, 3, 1), (died, 0, 1), (died, 2, 3)):
        count = []

        def build(config, error=error):
            count.append(config)
            return make_trainer("sft", roles={"policy": BatchesSeen("policy", fail_at=1, error=error)}, run_config=config,
                                data=FakeDataSource(_batch()))

        cfg = RunConfig.from_dict({"num_steps": 2, "max_restarts": max_restarts, "save": str(tmp_path / "c"),
                                   "progress_bar": False})
        with pytest.raises(type(error)):
            run_with_restarts(cfg, build)
        assert len(count) == builds
        assert all(config.model.load is None for config in count)  # no checkpoint yet: from the start again


def test_with_overwrite_an_older_runs_checkpoints_are_never_resumed(tmp_path):
    save = tmp_path / "ckpt"
    (save / "step_000000009").mkdir(parents=True)
    (save / "step_000000009" / "manifest.json").write_text("{}")
    cfg = RunConfig.from_dict({"save": str(save), "overwrite": True, "max_restarts": 1})
    point = ResumePoint(cfg)
    assert point.newest() is None and point.restart_config() is cfg
    (save / "step_000000002").mkdir()
    (save / "step_000000002" / "manifest.json").write_text("{}")
    assert point.restart_config().model.load == str(save / "step_000000002")


# ---- restarts under torchrun (torch elastic restarts the ranks) ---------------------------------


def test_a_rank_torch_elastic_restarted_loads_the_newest_checkpoint(tmp_path, capsys):
    save = tmp_path / "ckpt"
    for step in (3, 6):
        (save / f"step_00000000{step}").mkdir(parents=True)
        (save / f"step_00000000{step}" / "manifest.json").write_text("{}")
    cfg = RunConfig.from_dict({"save": str(save), "max_restarts": 1})
    assert elastic_restart_config(cfg, environ={}) is cfg  # the first start
    restarted = elastic_restart_config(cfg, environ={"TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0"})
    assert restarted.model.load == str(save / "step_000000006")
    assert "restart 1 (torch elastic) from checkpoint" in capsys.readouterr().err
    again = elastic_restart_config(restarted, environ={"TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0"})
    assert again is restarted and capsys.readouterr().err == ""  # resolved once, announced once


def test_a_restarted_rank_0_takes_the_save_lock_once_the_dead_one_has_dropped_it(tmp_path):
    from stacx.trainer.save_lock import SaveFolderInUse, hold_save_folder

    save = str(tmp_path / "ckpt")
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=hold_the_save_lock_until_released, args=(save, held, release))
    holder.start()
    try:
        assert held.wait(60)
        with pytest.raises(SaveFolderInUse), hold_save_folder(save, wait_s=0.3):
            pass
        release.set()  # the old rank 0 ends while the new one waits
        started = time.monotonic()
        with hold_save_folder(save, wait_s=60):
            assert time.monotonic() - started < 60
    finally:
        release.set()
        holder.join(30)


def test_a_waiter_that_opened_the_lock_file_before_the_holder_removed_it_holds_the_folders_lock(tmp_path, monkeypatch):
    """A holder that created the folder and saved nothing removes lock file and folder as it releases them. A
    waiter that had already opened the old file used to lock that removed file (guarding nothing: a third run
    then took the folder too), or failed making the folder it saw vanish (FileExistsError, seen once in
    `make test-fast`). It now locks the file that is at the lock's path. The release is made to fall between the
    waiter's open and its lock (its first lock attempt waits for it)."""
    import fcntl
    import threading
    import types

    from stacx.trainer import save_lock
    from stacx.trainer.save_lock import SaveFolderInUse, hold_save_folder, lock_path

    save = str(tmp_path / "ckpt")
    release_now, released = threading.Event(), threading.Event()
    waiter_holds, waiter_may_end = threading.Event(), threading.Event()
    errors = []

    def flock_after_the_release(handle, operation):
        if threading.current_thread().name == "waiter" and operation & fcntl.LOCK_EX and not release_now.is_set():
            release_now.set()  # the waiter has the old file open: the holder releases it now
            assert released.wait(60)
        return fcntl.flock(handle, operation)

    monkeypatch.setattr(save_lock, "fcntl", types.SimpleNamespace(**{name: getattr(fcntl, name) for name in (
        "LOCK_EX", "LOCK_NB", "LOCK_SH", "LOCK_UN")}, flock=flock_after_the_release))

    def waiter():
        try:
            with hold_save_folder(save, wait_s=60, poll_s=0.05):
                waiter_holds.set()
                waiter_may_end.wait(60)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            waiter_holds.set()

    thread = threading.Thread(target=waiter, name="waiter", daemon=True)
    with hold_save_folder(save):  # creates the folder; saves nothing into it
        thread.start()
        assert release_now.wait(60)
    released.set()
    try:
        assert waiter_holds.wait(60) and not errors, errors
        assert os.path.isdir(save) and lock_path(save).exists()
        with pytest.raises(SaveFolderInUse), hold_save_folder(save):  # the folder is the waiter's now
            pass
    finally:
        waiter_may_end.set()
        thread.join(60)
    assert not errors, errors


def test_stacx_torchrun_hands_the_runs_max_restarts_to_torch_elastic():
    from stacx.launch.commands.torchrun import with_elastic_restarts

    argv = ["--standalone", "--nproc-per-node", "2", "-m", "stacx.train", "--algorithm", "sft", "--max-restarts", "2"]
    assert with_elastic_restarts(argv) == ["--max-restarts", "2", *argv]
    assert with_elastic_restarts(["--max-restarts=1", "-m", "stacx.train", "--max-restarts", "3"])[0] == "--max-restarts=1"
    assert with_elastic_restarts(["-m", "stacx.train", "--max-restarts=4"]) == [
        "--max-restarts", "4", "-m", "stacx.train", "--max-restarts=4"]
    plain = ["--standalone", "-m", "stacx.train", "--algorithm", "sft"]
    assert with_elastic_restarts(plain) == plain
