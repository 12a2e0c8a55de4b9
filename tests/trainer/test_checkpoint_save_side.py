"""The save side of checkpoints: a run never overwrites another run's --save folder by accident, and
the staging folders of an interrupted save are removed by the run that began them."""

from __future__ import annotations

import os

import pytest

from stacx.trainer.checkpoint import (CheckpointError, check_save_folder, read_manifest, remove_checkpoints,
                                      remove_staging_folders)


def _fake_step(root, step: int) -> str:
    folder = root / f"step_{step:09d}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return str(folder)


def test_another_runs_checkpoints_are_refused_unless_resumed_or_overwritten(tmp_path):
    save = tmp_path / "ckpt"
    check_save_folder(str(save), load=None, overwrite=False)  # nothing there yet
    _fake_step(save, 1)
    latest = _fake_step(save, 2)
    with pytest.raises(CheckpointError, match=r"--save .*ckpt already holds checkpoints of another run \(steps 1, 2\)"):
        check_save_folder(str(save), load=None, overwrite=False)
    with pytest.raises(CheckpointError):
        check_save_folder(str(save), load=str(tmp_path / "elsewhere"), overwrite=False)
    check_save_folder(str(save), load=str(save), overwrite=False)  # resuming it
    check_save_folder(str(save), load=latest, overwrite=False)  # resuming one of its steps
    check_save_folder(str(save), load=None, overwrite=True)
    assert remove_checkpoints(str(save)) and not os.listdir(save)


def test_only_this_processes_staging_folders_are_removed(tmp_path):
    mine = tmp_path / f".staging-step_000000003-{os.getpid()}-abcd1234"
    other = tmp_path / ".staging-step_000000003-1-abcd1234"
    committed = tmp_path / "step_000000002"
    for folder in (mine, other, committed):
        folder.mkdir()
    assert remove_staging_folders(str(tmp_path)) == [str(mine)]
    assert sorted(os.listdir(tmp_path)) == sorted([other.name, committed.name])
    assert remove_staging_folders(str(tmp_path / "absent")) == []


def test_a_truncated_manifest_is_named_with_its_path(tmp_path):
    (tmp_path / "manifest.json").write_text('{"step": 3, "ro')
    with pytest.raises(CheckpointError, match=r"manifest.json is not valid JSON .*truncated"):
        read_manifest(str(tmp_path))


def test_the_trainers_first_save_with_overwrite_removes_the_older_runs_steps(tmp_path, monkeypatch):
    """Without it, the older run's later steps would look like this run's latest checkpoint on resume."""
    from stacx.trainer.config.run import RunConfig
    from tests.trainer.fakes import make_trainer

    save = tmp_path / "ckpt"
    _fake_step(save, 5)
    trainer = make_trainer("sft", roles={}, run_config=RunConfig.from_dict({"save": str(save), "overwrite": True}))
    trainer.check_save_folder()  # --overwrite: allowed
    began = []

    def stop_after_removal(root, step):
        began.append(sorted(os.listdir(root)))
        raise RuntimeError("stop here")

    monkeypatch.setattr("stacx.trainer.loop.begin_checkpoint", stop_after_removal)
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.save_checkpoint(1)
    assert began == [[]]
    trainer.run_config = RunConfig.from_dict({"save": str(save)})
    _fake_step(save, 5)
    with pytest.raises(CheckpointError, match="already holds checkpoints of another run"):
        trainer.check_save_folder()
