"""`stacx train --dry-run` runs the run's own preflight: every setting that would fail the run later
is refused up front (exit 2) with a one-paragraph message naming the flag."""

from __future__ import annotations

import json
import os

import pytest

from stacx.launch.cli import main


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    from stacx.tasks import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("dry_run")
    paths = {"root": str(root), "ckpt": write_tiny_checkpoint(str(root / "ckpt"), "addition")}
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "2+2="}, {"prompt": "4+1=", "label": ""}]
    paths["unlabeled"] = str(root / "unlabeled.jsonl")
    with open(paths["unlabeled"], "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    paths["long"] = str(root / "long.jsonl")
    with open(paths["long"], "w") as handle:
        handle.write(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
        handle.write(json.dumps({"prompt": "1+" * 40 + "1=", "label": "41"}) + "\n")
    return paths


def _train(inputs, *flags: str, capsys) -> tuple[int, str, str]:
    base = ["train", "--algorithm", "grpo", "--hf-checkpoint", inputs["ckpt"], "--prompt-data", "builtin:addition",
            "--rollout-max-response-len", "8", "--out", os.path.join(inputs["root"], "out"), "--dry-run"]
    code = main(base + list(flags))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_tiny_run_passes(inputs, capsys):
    code, out, err = _train(inputs, capsys=capsys)
    assert code == 0, err
    assert out.startswith("recipe grpo:")
    # no --ref-load given: the dry run does not promise a reference from it
    assert "no in-worker reference (--ref-load not set)" in out and "in-worker reference from" not in out


@pytest.mark.parametrize("flags, named", [
    (["--rollout-batch-size", "0"], "--rollout-batch-size"),
    (["--save-interval", "-1"], "--save-interval"),
    (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt"),
    (["--hf-checkpoint", "/nonexistent/ckpt"], "--hf-checkpoint /nonexistent/ckpt: no such folder"),
    (["--prompt-data", "missing.jsonl"], "--prompt-data missing.jsonl: no such file"),
    (["--prompt-data", "builtin:no_such_task"], "--prompt-data builtin:no_such_task"),
    (["--load", "/nonexistent/run"], "--load /nonexistent/run: no such folder"),
    (["--use-kl-loss"], "--ref-load is not set"),
    (["--ref-load", "/nonexistent/ref"], "--ref-load /nonexistent/ref: no such folder"),
    (["--rollout-engine", "http"], "--rollout-urls"),
    (["--reward-fn", "no_such_module:fn"], "--reward-fn"),
    (["--rollout-max-response-len", "64"], "--rollout-max-response-len"),
    (["--lr", "nan"], "key 'lr' in command line must be a finite number, got nan; set --lr to a number"),
])
def test_each_bad_setting_is_refused_naming_its_flag(inputs, capsys, flags, named):
    code, out, err = _train(inputs, *flags, capsys=capsys)
    assert code == 2 and out == ""
    assert named in err
    assert err.count("\n") == 1 and "Traceback" not in err  # one paragraph, no traceback


def test_a_distillation_recipe_without_teacher_url_is_refused(inputs, capsys):
    code, _, err = _train(inputs, "--algorithm", "opd", capsys=capsys)
    assert code == 2 and "--teacher-url is not set" in err and "'opd'" in err


def test_rows_without_the_label_the_reward_compares_with_are_named(inputs, capsys):
    code, _, err = _train(inputs, "--prompt-data", inputs["unlabeled"], capsys=capsys)
    assert code == 2
    assert "2 of 3 rows" in err and "unlabeled.jsonl:2" in err and "unlabeled.jsonl:3" in err
    assert "--label-key" in err and "--reward-fn exact_match" in err
    code, _, err = _train(inputs, "--prompt-data", inputs["unlabeled"], "--reward-fn", "format", capsys=capsys)
    assert code == 0, err  # the format reward reads no label


def test_a_prompt_longer_than_the_context_is_named(inputs, capsys):
    code, _, err = _train(inputs, "--prompt-data", inputs["long"], capsys=capsys)
    assert code == 2
    assert "1 of 2 rows" in err and "long.jsonl:2" in err and "context of 64 tokens" in err


def test_a_dict_for_a_string_field_is_refused_naming_the_file_and_key(inputs, capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("rollout:\n  reward_fn: {name: exact_match}\n")
    code, _, err = _train(inputs, "--config", str(config), capsys=capsys)
    assert code == 2 and "reward_fn" in err and str(config) in err and "expects a string" in err


def test_a_truncated_manifest_is_named(inputs, capsys, tmp_path):
    step = tmp_path / "run" / "step_000000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"format_version": 1, "step": 2, "reci')
    code, _, err = _train(inputs, "--load", str(tmp_path / "run"), capsys=capsys)
    assert code == 2 and str(step / "manifest.json") in err and "truncated" in err


def test_save_into_another_runs_folder_is_refused_unless_resumed_or_overwritten(inputs, capsys, tmp_path):
    save = tmp_path / "ckpt"
    (save / "step_000000002").mkdir(parents=True)
    (save / "step_000000002" / "manifest.json").write_text("{}")
    code, _, err = _train(inputs, "--save", str(save), capsys=capsys)
    assert code == 2 and f"--save {save} already holds checkpoints of another run (steps 2)" in err
    assert "--overwrite" in err and f"--load {save}" in err
    assert _train(inputs, "--save", str(save), "--overwrite", capsys=capsys)[0] == 0


def test_the_header_and_the_resolved_config_agree_on_the_kl_loss(inputs, capsys):
    code, out, err = _train(inputs, "--use-kl-loss", "--kl-loss-coef", "0.05", "--ref-load", inputs["ckpt"],
                            capsys=capsys)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("  algorithm:"))
    assert "KL loss low_var_kl x 0.05" in header and "no KL loss" not in out
    assert "use_kl_loss: true" in out
    assert "in-worker reference from --ref-load" in out and "not set" not in out


def test_a_misspelled_advantage_estimator_is_refused_at_preflight_with_a_suggestion(inputs, capsys):
    """It passed --dry-run and failed 22 s into the run, after Ray had started, with a traceback."""
    code, out, err = _train(inputs, "--advantage-estimator", "grpp", capsys=capsys)
    assert code == 2 and out == ""
    assert "--advantage-estimator" in err and "'grpp'" in err and "did you mean 'grpo'?" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_prompts_are_refused_naming_file_and_line(inputs, capsys, tmp_path):
    """They passed --dry-run; the run failed 88 s later with `input_ids must not be empty` and no file."""
    data = tmp_path / "empty.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in [{"prompt": "1+2=", "label": "3"}, {"prompt": "", "label": "4"}])
                    + "\n")
    code, _, err = _train(inputs, "--prompt-data", str(data), capsys=capsys)
    assert code == 2 and "1 of 2 rows" in err and "empty.jsonl:2" in err and "empty prompt" in err


def test_a_dry_run_writes_nothing(inputs, capsys, tmp_path, monkeypatch):
    """A built-in task's rows were written under outputs/ by a dry run."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "fresh_out"
    code = main(["train", "--algorithm", "grpo", "--hf-checkpoint", inputs["ckpt"], "--prompt-data", "builtin:addition",
                 "--rollout-max-response-len", "8", "--out", str(out), "--dry-run"])
    assert code == 0, capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == []  # no --out folder, no outputs/ in the working directory


def test_a_ref_load_no_role_reads_is_named_and_refused_when_missing(inputs, capsys):
    """It was silently ignored, even for a path that does not exist."""
    code, _, err = _train(inputs, "--algorithm", "sft", "--ref-load", "/nonexistent/ref", capsys=capsys)
    assert code == 2 and "--ref-load /nonexistent/ref is set, but recipe 'sft' has no role that reads it" in err
    assert "/nonexistent/ref does not exist" in err
    code, _, err = _train(inputs, "--algorithm", "sft", "--ref-load", inputs["ckpt"], capsys=capsys)
    assert code == 0 and f"stacx train: warning: --ref-load {inputs['ckpt']} is set, but recipe 'sft'" in err
    code, _, err = _train(inputs, "--ref-load", inputs["ckpt"], capsys=capsys)
    assert code == 0 and "warning" not in err  # grpo's policy holds a reference


def test_the_default_response_length_fits_a_small_context_and_a_given_one_is_kept(inputs, capsys):
    base = ["train", "--algorithm", "grpo", "--hf-checkpoint", inputs["ckpt"], "--prompt-data", "builtin:addition",
            "--out", os.path.join(inputs["root"], "out"), "--dry-run"]
    code = main(base)  # no --rollout-max-response-len: 64 would not fit the 64-token context
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "rollout_max_response_len: 32" in captured.out
    assert main(base + ["--rollout-max-response-len", "60"]) == 2
    assert "--rollout-max-response-len 60" in capsys.readouterr().err


def test_the_dry_run_shows_the_settings_the_recipe_reads_and_every_given_one(inputs, capsys):
    code, out, err = _train(inputs, "--algorithm-param", "dpo_beta=0.3", capsys=capsys)
    assert code == 0, err
    config = out.split("resolved run config", 1)[1]
    for unread in ("teacher:", "dagger_", "distill_kl_mode", "label_smoothing", "value_clip", "critic_load"):
        assert unread not in config, unread
    assert "dpo_beta: 0.3" in config  # given, so shown although GRPO does not read it
    assert "policy_loss: ppo_clip" in config and "rollout_temperature" in config
    assert "settings it does not read are left out" in config
    assert len(out.splitlines()) < 110


def test_a_specialization_without_the_policy_loss_is_not_summarized_with_one():
    from stacx.specializations.actor import ActorSpecialization
    from stacx.specializations.base import Specialization
    from stacx.trainer.config.recipe import ModelRole, TrainingConfig, recipe_algorithm

    class WeightedNLL(Specialization):
        base_required_fields = ("advantages",)

    class CustomActorLoss(ActorSpecialization):
        def per_token_terms(self, view, batch):
            raise NotImplementedError

    def described(cls) -> str:
        return TrainingConfig(name="weighted_nll", description="test recipe", data_source="rollout", uses_reward=True,
                              algorithm=recipe_algorithm(advantage_estimator="grpo"),
                              roles=(ModelRole(name="policy", specialization_cls=cls, trainable=True,
                                               sync_to_rollout=True),)).describe()

    for cls in (WeightedNLL, CustomActorLoss):
        line = next(line for line in described(cls).splitlines() if line.startswith("  algorithm:"))
        assert "ppo_clip" not in line and f"{cls.__name__}.per_token_terms" in line and "advantages grpo" in line
    assert "loss ppo_clip (clip 0.2/0.2)" in described(ActorSpecialization)


@pytest.mark.parametrize("module, flags, typo, knob", [
    ("examples/custom_algorithm/my_algo.py", ["--advantage-estimator", "rank_centered", "--policy-loss", "tempered_pg"],
     "pg_temprature", "pg_temperature"),
    ("examples/padded_plugins/custom_reinforce.py", ["--advantage-estimator", "reinforce_baseline", "--policy-loss",
                                               "reinforce_pg"], "basline", "baseline"),
])
def test_a_misspelled_algorithm_param_of_a_plugin_that_declares_its_knobs_is_refused(inputs, capsys, module, flags,
                                                                                      typo, knob):
    """It ran with the kernel's default, silently: the misspelled key was kept as an unread custom key."""
    code, out, err = _train(inputs, "--custom-module", module, *flags, "--algorithm-param", f"{typo}=0.5",
                            capsys=capsys)
    assert code == 2 and out == ""
    assert f"--algorithm-param {typo}" in err and f"did you mean '{knob}'?" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    # Spelled right, or declared as meant, it passes.
    code, out, err = _train(inputs, "--custom-module", module, *flags, "--algorithm-param", f"{knob}=0.5", capsys=capsys)
    assert code == 0, err
    code, out, err = _train(inputs, "--custom-module", module, *flags, "--algorithm-param", f"{typo}=0.5",
                            "--algorithm-param", f"custom_hyperparameters=[{typo}]", capsys=capsys)
    assert code == 0, err


def test_a_padded_plugin_that_aggregates_itself_under_another_loss_agg_mode_is_refused(inputs, capsys):
    """It passed --dry-run and failed at step 0 with a traceback on every rank; now preflight names both modes."""
    flags = ["--custom-module", "examples/padded_plugins/my_algorithm.py", "--policy-loss", "my_loss",
             "--advantage-estimator", "my_advantage"]
    code, out, err = _train(inputs, *flags, "--loss-agg-mode", "seq-mean-token-mean", capsys=capsys)
    assert code == 2 and out == ""
    assert "--loss-agg-mode seq-mean-token-mean" in err and "'token-mean'" in err and "Traceback" not in err
    code, out, err = _train(inputs, *flags, "--loss-agg-mode", "token-mean", capsys=capsys)
    assert code == 0, err


def test_wandb_project_without_the_wandb_package_is_refused_at_preflight(inputs, capsys, monkeypatch):
    """It failed after the workers and the rollout server had started."""
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as where the package is not installed
    code, out, err = _train(inputs, "--wandb-project", "my-project", capsys=capsys)
    assert code == 2 and out == ""
    assert "--wandb-project my-project" in err and "pip install wandb" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_async_rollout_flags_in_the_dry_run_and_their_refusals(inputs, capsys):
    code, out, err = _train(inputs, capsys=capsys)
    assert code == 0 and "max_staleness" not in out  # sync: the async settings are not read
    code, out, err = _train(inputs, "--rollout-mode", "async", "--max-staleness", "2", "--partial-rollout",
                            capsys=capsys)
    assert code == 0, err
    config = out.split("resolved run config", 1)[1]
    assert "rollout_mode: async" in config and "max_staleness: 2" in config and "partial_rollout: true" in config
    # One optimizer step per rollout: pi_prox is the step's own forward (no recompute); several: recomputed.
    assert "off_policy_corrections: token_tis" in config and "recompute_old_log_probs: false" in config
    code, out, err = _train(inputs, "--rollout-mode", "async", "--max-staleness", "1", "--num-steps-per-rollout", "2",
                            capsys=capsys)
    assert code == 0, err
    assert "recompute_old_log_probs: true" in out.split("resolved run config", 1)[1]
    code, _, err = _train(inputs, "--rollout-mode", "async", "--dynamic-sampling", capsys=capsys)
    assert code == 2 and "--dynamic-sampling" in err and "--rollout-mode async" in err
    code, _, err = _train(inputs, "--partial-rollout", capsys=capsys)
    assert code == 2 and "add --rollout-mode async" in err
    code, _, err = _train(inputs, "--rollout-mode", "async", "--no-recompute-old-log-probs", "--num-steps-per-rollout",
                          "2", capsys=capsys)
    assert code == 2 and "--no-recompute-old-log-probs" in err
    with pytest.raises(SystemExit):  # argparse names the choices
        _train(inputs, "--rollout-mode", "later", capsys=capsys)
    assert "--rollout-mode: invalid choice: 'later'" in capsys.readouterr().err


def test_a_checkpoint_error_at_the_start_is_one_line_not_a_traceback(inputs, capsys, monkeypatch):
    """What the preflight's size check cannot see (a start folder whose bytes changed, caught by its sha256
    when the run starts) ends the run with its message: before, a traceback."""
    import stacx.trainer
    from stacx.trainer.checkpoint import CheckpointError

    def corrupt(run_config):
        raise CheckpointError("--ref-load: checkpoint runs/x/step_000000001: roles/policy/model/__0_0.distcp does "
                              "not match its sha256 in the manifest; copy it again")

    monkeypatch.setattr(stacx.trainer, "run_training", corrupt)
    code = main(["train", "--algorithm", "grpo", "--hf-checkpoint", inputs["ckpt"], "--prompt-data", "builtin:addition",
                 "--rollout-max-response-len", "8", "--out", os.path.join(inputs["root"], "out_start")])
    err = capsys.readouterr().err
    assert code == 1 and "stacx train: --ref-load: checkpoint runs/x/step_000000001" in err and "Traceback" not in err
