"""Checks that used to fail after start-up with a traceback and now fail in the preflight (so in
--dry-run), naming the flag and the fix: a resume that disagrees with its checkpoint (--num-steps below
its step, another mini-batch split, a smaller async --max-staleness), an unsupported architecture, a
truncated safetensors file, a role folder that no longer matches its checkpoint's manifest, --lr nan,
--max-staleness without async mode, and an unknown advantage estimator's close matches."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from stacx.trainer.config.checks import PreflightError
from stacx.trainer.config.run import ConfigError, RunConfig
from stacx.trainer.resume_checks import check_resume


def _checkpoint(root, *, step=60, train=None, rollout=None, groups=()):
    """A training checkpoint's step folder as the resume checks read it: manifest, run config, driver state."""
    folder = root / f"step_{step:09d}"
    folder.mkdir(parents=True)
    torch.save({"step": step, "async": {"scheduler": {"groups": [{"admit_version": v} for v in groups]}}},
               folder / "driver.pt")
    (folder / "manifest.json").write_text(json.dumps({"step": step, "driver_state": {"path": "driver.pt"}}))
    saved = {"train": {"global_batch_size": 32, "num_steps_per_rollout": 1, "num_epochs": 1, **(train or {})},
             "rollout": {"max_staleness": 1, "rollout_batch_size": 2, **(rollout or {})}}
    (folder / "run_config.json").write_text(json.dumps(saved))
    return str(root)


def test_num_steps_below_the_checkpoints_step_is_refused_naming_both(tmp_path):
    load = _checkpoint(tmp_path)
    with pytest.raises(PreflightError, match=r"--num-steps 8 is below the step of the checkpoint --load .* "
                                             r"\(step_000000060: 60 steps done\).*give --num-steps 60 or more"):
        check_resume(RunConfig.from_dict({"load": load, "num_steps": 8}))
    check_resume(RunConfig.from_dict({"load": load, "num_steps": 80}))


def test_another_split_names_only_the_flag_given_and_says_the_checkpoint_keeps_its_own(tmp_path):
    load = _checkpoint(tmp_path)
    # What `stacx train --load X --num-steps-per-rollout 2` resolves to: the saved 32 beside the flag's 2.
    config = RunConfig.from_dict({"load": load, "num_steps": 80, "global_batch_size": 32, "num_steps_per_rollout": 2})
    with pytest.raises(PreflightError) as refused:
        check_resume(config)
    message = str(refused.value)
    assert message.startswith("--num-steps-per-rollout 2: the checkpoint --load")
    assert "keeps its own split" in message and "--global-batch-size 32, --num-steps-per-rollout 1" in message
    assert "Drop --num-steps-per-rollout to resume" in message and "--global-batch-size 32:" not in message
    check_resume(RunConfig.from_dict({"load": load, "num_steps": 80, "global_batch_size": 32,
                                      "num_steps_per_rollout": 1}))


def test_a_smaller_max_staleness_than_the_async_checkpoints_is_refused(tmp_path):
    load = _checkpoint(tmp_path, groups=(59, 59, 60, 60))  # K=1, B=2: the oldest are one version behind
    base = {"load": load, "num_steps": 80, "rollout_mode": "async", "rollout_batch_size": 2}
    with pytest.raises(PreflightError, match=r"--load .*: the checkpoint holds 4 generated, untrained groups .*"
                                             r"--max-staleness 0 .*written with.* \(--max-staleness 1, "
                                             r"--rollout-batch-size 2\)"):
        check_resume(RunConfig.from_dict({**base, "max_staleness": 0}))
    check_resume(RunConfig.from_dict({**base, "max_staleness": 1}))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_learning_rate_is_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match=rf"key 'lr' in command line must be a finite number.*set --lr to a number"):
        RunConfig.from_dict({"lr": value}, source="command line")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from stacx.tasks import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("preflight") / "ckpt"), "addition")


def _copy(tiny, tmp_path, name="copy") -> str:
    folder = tmp_path / name
    shutil.copytree(tiny, folder)
    return str(folder)


def _preflight_checkpoints(hf_checkpoint, **values):
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.preflight import check_checkpoints

    config = RunConfig.from_dict({"algorithm": "grpo", "hf_checkpoint": hf_checkpoint, **values})
    recipe, algorithm = resolve_recipe(config)
    check_checkpoints(config, recipe, algorithm)


def test_an_unsupported_architecture_is_refused_naming_the_flag(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    config["model_type"] = "gpt2"
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(config, handle)
    with pytest.raises(PreflightError, match=rf"--hf-checkpoint {folder}: unsupported architecture 'gpt2'.*supported"):
        _preflight_checkpoints(folder)


def test_a_truncated_safetensors_file_is_refused_naming_the_file(tiny, tmp_path):
    _preflight_checkpoints(tiny)  # the whole checkpoint passes
    folder = _copy(tiny, tmp_path)
    (weights,) = [name for name in os.listdir(folder) if name.endswith(".safetensors")]
    path = os.path.join(folder, weights)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    with pytest.raises(PreflightError, match=rf"--hf-checkpoint: {path} has \d+ bytes, its header says \d+; the "
                                             "file is truncated"):
        _preflight_checkpoints(folder)
    with open(path, "r+b") as handle:
        handle.truncate(4)
    with pytest.raises(PreflightError, match="too few for a safetensors header"):
        _preflight_checkpoints(folder)


def test_a_corrupt_role_folder_of_a_checkpoint_is_refused_by_the_preflight(tiny, tmp_path):
    """--ref-load pointing at `step_*/roles/policy/model` whose file no longer matches the manifest."""
    step = tmp_path / "run" / "step_000000001"
    model = step / "roles" / "policy" / "model"
    model.mkdir(parents=True)
    (model / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (model / "__0_0.distcp").write_bytes(b"x" * 10)
    (model / ".metadata").write_bytes(b"m")
    entry = {"path": "roles/policy/rank_00000.pt", "size": 1, "sha256": "0",
             "model_files": [{"path": "roles/policy/model/__0_0.distcp", "size": 100, "sha256": "0"}]}
    (step / "manifest.json").write_text(json.dumps({"step": 1, "roles": {"policy": {"ranks": [entry]}}}))
    with pytest.raises(PreflightError, match=r"--ref-load: checkpoint .*__0_0.distcp has 10 bytes, the manifest "
                                             r"says 100"):
        _preflight_checkpoints(tiny, ref_load=str(model), use_kl_loss=True)


def test_max_staleness_without_async_mode_is_reported_as_ignored():
    from stacx.trainer.preflight import ignored_settings

    (message,) = ignored_settings(RunConfig.from_dict({"max_staleness": 4}))
    assert message.startswith("--max-staleness 4 is set, but --rollout-mode is 'sync'") and "--rollout-mode async" in message
    assert ignored_settings(RunConfig.from_dict({"max_staleness": 4, "rollout_mode": "async"})) == []
    assert ignored_settings(RunConfig.from_dict({})) == []


def test_an_unknown_advantage_estimator_is_refused_with_its_close_matches():
    from stacx.trainer.config.algorithm import infer_algorithm
    from stacx.trainer.config.recipe import RecipeError

    with pytest.raises(RecipeError, match=r"--advantage-estimator 'gpro' is not a registered advantage estimator; "
                                          r"did you mean 'grpo'\?"):
        infer_algorithm({"advantage_estimator": "gpro"})
    # (estimators other tests of this worker registered may be among the close matches too)
    with pytest.raises(RecipeError, match=r"did you mean 'reinforce_plus_plus' or ") as refused:
        infer_algorithm({"advantage_estimator": "reinforce_pp"})
    assert "'reinforce_plus_plus_baseline'" in str(refused.value).split("registered:")[0]


def test_stacx_train_names_only_the_split_flag_given_when_resuming(tiny, tmp_path, capsys):
    """Before: `--load X --num-steps-per-rollout 2` was refused naming `--global-batch-size 32`, a flag the
    user never gave (the value saved with the checkpoint)."""
    from stacx.launch.cli import main

    load = _checkpoint(tmp_path / "run", step=4, train={"algorithm": "grpo", "num_steps": 8},
                       rollout={"rollout_batch_size": 8, "n_samples_per_prompt": 4, "prompt_data": "builtin:addition",
                                "rollout_max_response_len": 8})
    saved = tmp_path / "run" / "step_000000004" / "run_config.json"
    values = json.loads(saved.read_text())
    saved.write_text(json.dumps({**values, "model": {"hf_checkpoint": tiny}}))
    assert main(["train", "--load", load, "--num-steps-per-rollout", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "stacx train: --num-steps-per-rollout 2: the checkpoint --load" in err and "keeps its own split" in err
    assert "--dry-run" not in err  # not reported as overriding the saved run config
