"""`stacx train --load runs/x` resumes with the run config saved with the checkpoint; flags given
next to it override it, and each override is printed."""

from __future__ import annotations

import argparse

from stacx.launch.run_flags import add_run_config_arguments, resume_overrides, run_config_from_args
from stacx.trainer.checkpoint import save_checkpoint
from stacx.trainer.factory import resolve_recipe
from stacx.trainer.config.resolve import resolved_run_config_dict


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return parser.parse_args(list(argv))


def _saved_run(tmp_path) -> str:
    original = run_config_from_args(_args(
        "--algorithm", "grpo", "--hf-checkpoint", "models/policy", "--prompt-data", "builtin:addition",
        "--lr", "3e-4", "--num-steps", "20", "--save", str(tmp_path / "run"), "--clip-ratio-high", "0.28"))
    _, algorithm = resolve_recipe(original)
    save_checkpoint(tmp_path / "run", 4, recipe="grpo", role_layouts={}, role_states={}, driver_state={},
                    resolved_run_config=resolved_run_config_dict(original, algorithm))
    return str(tmp_path / "run")


def test_load_alone_resumes_with_the_saved_run_config(tmp_path):
    root = _saved_run(tmp_path)
    args = _args("--load", root)
    resumed = run_config_from_args(args)
    assert resumed.model.hf_checkpoint == "models/policy" and resumed.rollout.prompt_data == "builtin:addition"
    assert resumed.optim.lr == 3e-4 and resumed.train.num_steps == 20 and resumed.train.algorithm == "grpo"
    assert resumed.model.save == root and resumed.model.load == root
    assert resolve_recipe(resumed)[1].clip_ratio_high == 0.28
    assert resume_overrides(args, resumed) == []


def test_flags_next_to_load_override_the_saved_config_and_are_listed(tmp_path):
    root = _saved_run(tmp_path)
    args = _args("--load", root, "--num-steps", "40", "--lr", "3e-4", "--clip-ratio-high", "0.3")
    resumed = run_config_from_args(args)
    assert resumed.train.num_steps == 40 and resumed.optim.lr == 3e-4
    assert resume_overrides(args, resumed) == ["--num-steps 40 (saved: 20)", "--clip-ratio-high 0.3 (saved: 0.28)"]
    # With --config, the file is the base and nothing is taken from the checkpoint.
    config = tmp_path / "run.yaml"
    config.write_text("algorithm: sft\nhf_checkpoint: other\n")
    with_file = _args("--config", str(config), "--load", root)
    assert run_config_from_args(with_file).model.hf_checkpoint == "other" and resume_overrides(with_file, None) == []
    # A --load folder with no checkpoint yet: nothing to take, the flags alone make the run.
    fresh = _args("--load", str(tmp_path / "empty"), "--algorithm", "sft")
    assert run_config_from_args(fresh).train.algorithm == "sft" and resume_overrides(fresh, None) == []
