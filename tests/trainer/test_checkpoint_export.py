"""A training checkpoint's role weights exported as a Hugging Face folder (what `stacx eval --load` reads):
the role's torch_dist weights, vocabulary padding stripped, the run's own weights (not the base checkpoint's).
Exports of checkpoints saved at tp=2 are covered by tests/checkpointing (torch_dist loads at any tp)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from stacx.models.testing import save_tiny_hf_checkpoint
from stacx.trainer.checkpoint import CheckpointError, read_manifest
from stacx.trainer.checkpoint_export import base_checkpoint_of, export_role_to_hf, pick_role
from tests.checkpointing.helpers import write_training_checkpoint


def _hf_tensors(folder) -> dict:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def test_export_writes_the_runs_own_weights(tmp_path):
    base = str(tmp_path / "base")
    save_tiny_hf_checkpoint(base, "llama", seed=0)
    step = write_training_checkpoint(base, tmp_path / "checkpoints", 3, scale=2.0)
    manifest = read_manifest(step)
    role = pick_role(manifest, None)
    out = export_role_to_hf(step, role, base_checkpoint_of(step), tmp_path / "export")
    exported, original = _hf_tensors(out), _hf_tensors(base)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].shape == tensor.shape, name  # padding stripped
        assert bool((exported[name] == 2.0 * tensor).all()), name  # the checkpoint's weights, not the base's
    assert json.loads((tmp_path / "export" / "config.json").read_text())["vocab_size"] == 101


def test_moved_base_and_unknown_role_are_named(tmp_path):
    base = str(tmp_path / "base")
    save_tiny_hf_checkpoint(base, "llama", seed=0)
    step = write_training_checkpoint(base, tmp_path / "checkpoints", 3)
    moved = str(tmp_path / "moved")
    shutil.move(base, moved)
    with pytest.raises(CheckpointError, match=r"--hf-checkpoint .*base: folder not found.*pass --hf-checkpoint"):
        base_checkpoint_of(step)
    assert base_checkpoint_of(step, moved) == moved
    with pytest.raises(CheckpointError, match=r"--role 'critic': the checkpoint has no such role; its roles: \['policy'\]"):
        pick_role(read_manifest(step), "critic")
    with pytest.raises(CheckpointError, match="choose one with --role"):
        pick_role({"roles": {"student": {}, "teacher": {}}}, None)
    assert pick_role({"roles": {"actor": {}, "critic": {}}}, None) == "actor"
