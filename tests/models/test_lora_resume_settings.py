"""Resuming a LoRA run (`stacx train --load RUN`) with other LoRA settings than the checkpoint's: the ones that
make its policy or its optimizer state (--lora-plus-ratio, --lora-rslora, --lora-alpha, --lora-rank,
--lora-target-modules) are refused before start-up, naming both values and the way on; the others
(--lora-dropout, --lora-sync) resume. The flags are parsed as `stacx train` parses them, so the saved run config
is the file and the flag overrides it."""

from __future__ import annotations

import argparse
import json

import pytest

from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args
from stacx.trainer.config.checks import PreflightError
from stacx.trainer.config.run import RunConfig
from stacx.trainer.resume_checks import check_resume

SAVED_LORA = {"lora_rank": 8, "lora_alpha": 16.0, "lora_plus_ratio": 16.0, "lora_rslora": False,
              "lora_target_modules": ["all-linear"]}


def _lora_checkpoint(root, **model) -> str:
    """A training checkpoint's step folder as `stacx train --load` reads it: its manifest and the run config saved
    from a LoRA run (`model` overrides the saved LoRA fields)."""
    folder = root / "step_000000004"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"step": 4}))
    saved = RunConfig.from_dict({"num_steps": 4, **SAVED_LORA, **model}).to_dict()
    (folder / "run_config.json").write_text(json.dumps(saved))
    return str(root)


def _resumed(*argv: str) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(list(argv)))


def test_another_lora_plus_ratio_is_refused_naming_both_values_and_a_new_run_from_the_adapters(tmp_path):
    load = _lora_checkpoint(tmp_path)
    with pytest.raises(PreflightError) as refused:
        check_resume(_resumed("--load", load, "--num-steps", "8", "--lora-plus-ratio", "4"))
    message = str(refused.value)
    assert message.startswith("--lora-plus-ratio 4 (the checkpoint's: --lora-plus-ratio 16): the checkpoint --load")
    assert "optimizer's param groups" in message and "Drop --lora-plus-ratio" in message
    assert "--lora adapter --out DIR`, then `stacx train --load DIR` with the new ratio" in message
    check_resume(_resumed("--load", load, "--num-steps", "8"))  # the checkpoint's ratio: resumes
    check_resume(_resumed("--load", load, "--num-steps", "8", "--lora-plus-ratio", "16"))


def test_plain_lora_resumed_with_lora_plus_is_refused_too(tmp_path):
    """From ratio 1 (one param group) to 16 (B in a group of its own): the optimizer state cannot hold it."""
    load = _lora_checkpoint(tmp_path, lora_plus_ratio=1.0)
    with pytest.raises(PreflightError, match=r"^--lora-plus-ratio 16 \(the checkpoint's: --lora-plus-ratio 1\)"):
        check_resume(_resumed("--load", load, "--num-steps", "8", "--lora-plus-ratio", "16"))


def test_another_scale_is_refused_and_points_at_a_new_run_from_the_merged_policy(tmp_path):
    load = _lora_checkpoint(tmp_path)
    with pytest.raises(PreflightError) as refused:
        check_resume(_resumed("--load", load, "--num-steps", "8", "--lora-rslora", "--lora-alpha", "32"))
    message = str(refused.value)
    assert message.startswith("--lora-alpha 32 (the checkpoint's: --lora-alpha 16), --lora-rslora (the checkpoint's: "
                              "--no-lora-rslora): ")
    assert "Drop --lora-alpha and --lora-rslora" in message
    assert "--lora merged --out DIR`, then `stacx train --hf-checkpoint DIR` with the new settings" in message


def test_other_adapter_tensors_are_refused(tmp_path):
    load = _lora_checkpoint(tmp_path)
    with pytest.raises(PreflightError, match=r"^--lora-rank 16 \(the checkpoint's: --lora-rank 8\), "
                                             r"--lora-target-modules linear_qkv \(the checkpoint's: "
                                             r"--lora-target-modules all-linear\)"):
        check_resume(_resumed("--load", load, "--num-steps", "8", "--lora-rank", "16",
                              "--lora-target-modules", "linear_qkv"))


def test_dropout_and_the_push_format_may_change_on_resume(tmp_path):
    load = _lora_checkpoint(tmp_path)
    check_resume(_resumed("--load", load, "--num-steps", "8", "--lora-dropout", "0.1", "--lora-sync", "adapters"))


def test_a_full_fine_tuning_checkpoint_is_not_compared(tmp_path):
    """lora_rank 0 saved: there are no adapters to keep (torch_dist's load names a LoRA-ness mismatch itself)."""
    load = _lora_checkpoint(tmp_path, lora_rank=0, lora_plus_ratio=1.0)
    check_resume(RunConfig.from_dict({"load": load, "num_steps": 8, "lora_rank": 0}))
