"""The save side of checkpoints: a run never overwrites another run's --save folder by accident, and
the staging folders of an interrupted save are removed by the run that began them."""

from __future__ import annotations

import os
import time

import pytest

from stacx.trainer.checkpoint import (CheckpointError, check_save_folder, read_manifest, remove_checkpoints,
                                      remove_stale_staging_folders, remove_staging_folders)


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


def _staging(root, name: str, *, age_s: float, files=("roles/policy/model/__0_0.distcp",)):
    """A staging folder whose every entry was last written `age_s` seconds ago."""
    folder = root / name
    for file in files:
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_bytes(b"x")
    when = time.time() - age_s
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (when, when))
    return folder


def test_a_killed_runs_staging_folders_go_at_the_next_start_and_save_and_live_ones_stay(tmp_path, monkeypatch):
    """A SIGKILLed driver leaves `.staging-step_*` folders that no later run removed; the next run into
    the folder removes those nothing writes into any more (its Ray workers may still write for minutes)."""
    from stacx.trainer.config.run import RunConfig
    from tests.trainer.fakes import make_trainer

    save = tmp_path / "ckpt"
    committed = _fake_step(save, 2)
    killed = _staging(save, ".staging-step_000000003-7-aaaa1111", age_s=3600)
    discarded = _staging(save, ".staging-discarded-step_000000002-bbbb2222", age_s=3600)
    # Its workers still write a shard: the folder itself is old, a file deep inside is new.
    writing = _staging(save, ".staging-step_000000004-7-cccc3333", age_s=3600)
    (writing / "roles" / "policy" / "model" / "__1_0.distcp").write_bytes(b"x")
    cut_between_renames = _staging(save, ".staging-step_000000005-7-dddd4444", age_s=3600, files=("manifest.json",))
    assert remove_stale_staging_folders(save) == [str(discarded), str(killed)]
    assert sorted(os.listdir(save)) == sorted([os.path.basename(committed), writing.name, cut_between_renames.name])

    trainer = make_trainer("sft", roles={}, run_config=RunConfig.from_dict({"save": str(save), "load": str(save)}))
    again = _staging(save, ".staging-step_000000003-8-eeee5555", age_s=3600)
    trainer.check_save_folder()  # the start of a run (resuming) into the folder
    assert not again.exists() and writing.exists()
    again = _staging(save, ".staging-step_000000003-9-ffff6666", age_s=3600)
    began = []

    def stop_at_begin(root, step):
        began.append(sorted(os.listdir(root)))
        raise RuntimeError("stop here")

    monkeypatch.setattr("stacx.trainer.loop.begin_checkpoint", stop_at_begin)
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.save_checkpoint(6)
    assert again.name not in began[0] and writing.name in began[0]


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
