"""Model-folder detection, `stacx convert` between Hugging Face, torch_dist and training checkpoints,
and the crash-safety and integrity of torch_dist training checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stacx.checkpointing.folders import HF, TORCH_DIST, ModelFolderError, detect_model_folder
from stacx.launch.cli import main as stacx_main
from stacx.models.checkpoint import TOKENIZER_FILES
from stacx.models.testing import save_tiny_hf_checkpoint
from stacx.tasks import write_tiny_checkpoint
from stacx.trainer.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from tests.checkpointing.helpers import write_training_checkpoint


def _hf_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def _assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _assert_generates(folder: str, source: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, original = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(source)
    prompt = tokenizer("31415=", return_tensors="pt", add_special_tokens=False)
    assert prompt["input_ids"].tolist() == original("31415=", return_tensors="pt", add_special_tokens=False)["input_ids"].tolist()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert generated.tolist() == reference.generate(**prompt, max_new_tokens=4, do_sample=False).tolist()


def test_folder_kinds_are_detected_and_anything_else_names_both_layouts(tmp_path):
    hf = str(tmp_path / "hf")
    save_tiny_hf_checkpoint(hf, "llama", seed=0)
    assert detect_model_folder(hf, flag="--ref-load") == HF
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (dist / ".metadata").write_bytes(b"")
    assert detect_model_folder(dist, flag="--ref-load") == TORCH_DIST

    (dist / ".metadata").unlink()  # a save cut short before its metadata
    with pytest.raises(ModelFolderError, match=r"--ref-load .*dist: this folder holds neither.*Hugging Face folder "
                                               r"\(config.json.*torch_dist folder \(metadata.json"):
        detect_model_folder(dist, flag="--ref-load")
    with pytest.raises(ModelFolderError, match=r"--load .*nowhere: folder not found"):
        detect_model_folder(tmp_path / "nowhere", flag="--load")
    step = tmp_path / "step_000000004"  # a training checkpoint's step folder, not one role's weights
    (step / "roles" / "policy" / "model").mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    with pytest.raises(ModelFolderError, match=r"--ref-load .*step_000000004: a training checkpoint's step folder.*"
                                               r"step_000000004/roles/ROLE/model \(its roles: policy\)"):
        detect_model_folder(step, flag="--ref-load")
    retired = tmp_path / "retired"
    retired.mkdir()
    (retired / "stacx_model.json").write_text(json.dumps({"format": "stacx-megatron-tp", "version": 1}))
    with pytest.raises(ModelFolderError, match=r"retired 'stacx-megatron-tp' format.*stacx convert hf-to-torch-dist"):
        detect_model_folder(retired, flag="--hf-checkpoint")


@pytest.mark.slow
@pytest.mark.distributed
def test_hf_round_trip_through_torch_dist_at_tp2_is_bitwise_and_the_export_generates(tmp_path):
    source = write_tiny_checkpoint(str(tmp_path / "hf"), "sorting", seed=1)
    dist, out = str(tmp_path / "dist"), str(tmp_path / "out")
    assert stacx_main(["convert", "hf-to-torch-dist", "--hf-checkpoint", source, "--tensor-model-parallel-size", "2",
                       "--out", dist]) == 0
    assert detect_model_folder(dist, flag="--ref-load") == TORCH_DIST
    assert stacx_main(["convert", "torch-dist-to-hf", "--load", dist, "--out", out]) == 0
    _assert_bitwise(_hf_tensors(out), _hf_tensors(source))
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    assert "generation_config.json" in copied and "tokenizer_config.json" in copied
    for name in copied:
        assert Path(out, name).read_bytes() == Path(source, name).read_bytes(), name
    _assert_generates(out, source)


def test_checkpoint_to_hf_exports_the_runs_weights_with_tokenizer(tmp_path, capsys):
    source = write_tiny_checkpoint(str(tmp_path / "hf"), "sorting", seed=2)
    step = write_training_checkpoint(source, tmp_path / "run", 4, scale=2.0)
    out = str(tmp_path / "export")
    assert stacx_main(["convert", "checkpoint-to-hf", "--load", str(tmp_path / "run"), "--role", "policy",
                       "--out", out]) == 0
    assert os.path.abspath(out) in capsys.readouterr().out
    exported, original = _hf_tensors(out), _hf_tensors(source)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], 2.0 * tensor), name  # the run's weights, not the base's
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).eos_token_id == AutoTokenizer.from_pretrained(source).eos_token_id
    assert stacx_main(["convert", "checkpoint-to-hf", "--load", step, "--role", "critic", "--out",
                       str(tmp_path / "other")]) == 2
    assert "--role 'critic'" in capsys.readouterr().err


def test_retired_format_commands_name_their_replacement(capsys):
    assert stacx_main(["convert", "hf-to-stacx", "--hf-checkpoint", "x", "--out", "y"]) == 2
    message = capsys.readouterr().err
    assert "retired" in message and "stacx convert hf-to-torch-dist" in message


def test_convert_help_lists_the_three_directions_and_nothing_hidden(capsys):
    """It printed `==SUPPRESS==` twice, for the retired directions."""
    import pytest

    with pytest.raises(SystemExit):
        stacx_main(["convert", "--help"])
    out = capsys.readouterr().out
    assert "SUPPRESS" not in out
    assert all(direction in out for direction in ("hf-to-torch-dist", "torch-dist-to-hf", "checkpoint-to-hf"))


def test_a_checkpoint_cut_short_at_any_file_is_never_picked_up(tmp_path):
    hf = str(tmp_path / "hf")
    save_tiny_hf_checkpoint(hf, "llama", seed=0)
    root = tmp_path / "run"
    first = write_training_checkpoint(hf, root, 1)
    complete = Path(write_training_checkpoint(hf, tmp_path / "complete", 2))
    # Every file, in the order the save wrote it: the manifest comes last.
    files = sorted((p for p in complete.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert files[-1].name == "manifest.json" and len(files) > 6
    for count in range(len(files)):
        for name in (".staging-step_000000002-1-deadbeef", "step_000000002"):  # before and (impossibly) after rename
            partial = root / name
            for path in files[:count]:
                target = partial / path.relative_to(complete)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
            partial.mkdir(exist_ok=True)
            assert latest_checkpoint(root) == first, (name, count)
            shutil.rmtree(partial)
    assert latest_checkpoint(tmp_path / "complete") == str(complete)


def test_a_corrupted_shard_is_named_by_every_reader(tmp_path, capsys):
    """`stacx train --load` refused the folder, but checkpoint-to-hf converted it with exit 0 (values up to
    1.8e37) and `stacx eval --load` scored it: every reader now checks the manifest's sha256 first."""
    from stacx.launch.commands.eval import resolve_model_folder
    from stacx.trainer.checkpoint import verify_start_folders
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.recipes import get_recipe

    hf = str(tmp_path / "hf")
    save_tiny_hf_checkpoint(hf, "llama", seed=0)
    step = Path(write_training_checkpoint(hf, tmp_path / "run", 3))
    model = step / "roles" / "policy" / "model"
    shard = next(model.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    named = rf"roles/policy/model/{shard.name} does not match its sha256 in the manifest; .*Copy it again"
    with pytest.raises(CheckpointError, match=named):
        load_checkpoint(tmp_path / "run", expected_recipe="sft", expected_layouts={})
    for direction, load in (("checkpoint-to-hf", tmp_path / "run"), ("torch-dist-to-hf", model)):
        out = tmp_path / f"out-{direction}"
        assert stacx_main(["convert", direction, "--load", str(load), "--hf-checkpoint", hf, "--out", str(out)]) == 2
        assert re.search(rf"--load: checkpoint .*{named}", capsys.readouterr().err), direction
        assert not out.exists()
    eval_args = argparse.Namespace(load=str(tmp_path / "run"), role=None, hf_checkpoint=None)
    with pytest.raises(CheckpointError, match=named):
        resolve_model_folder(eval_args, str(tmp_path / "scratch"))
    for field in ("ref_load", "load"):  # a role's folder of a training checkpoint as start or reference weights
        run_config = RunConfig.from_dict({"hf_checkpoint": hf, field: str(model)})
        with pytest.raises(CheckpointError, match="--" + field.replace("_", "-") + f": checkpoint .*{named}"):
            verify_start_folders(run_config.model, get_recipe("dpo"))
