"""A training checkpoint's role weights exported as a Hugging Face folder (what `stacx eval --load` reads):
every TP shard merged, vocabulary padding stripped, the run's own weights (not the base checkpoint's)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from stacx.models.stacx_checkpoint import convert_hf_to_stacx
from stacx.models.testing import save_tiny_hf_checkpoint
from stacx.trainer.checkpoint import CheckpointError, RankCoords, RoleLayout, read_manifest, save_checkpoint
from stacx.trainer.checkpoint_export import base_checkpoint_of, export_role_to_hf, pick_role


def _hf_tensors(folder) -> dict:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def _training_checkpoint(tmp_path, base: str, tp_size: int, dp_size: int, scale: float) -> str:
    """A step folder whose policy ranks hold the base weights times `scale`, sharded like a trainer's."""
    shards = tmp_path / "shards"
    convert_hf_to_stacx(base, str(shards), tp_size)
    layout = RoleLayout(tensor_parallel_size=tp_size, context_parallel_size=1, data_parallel_size=dp_size)
    states, coords = {}, {}
    for rank in range(layout.world_size):
        tp_rank, dp_rank = rank % tp_size, rank // tp_size
        model = {name: tensor * scale for name, tensor in load_file(str(shards / f"tp_rank_{tp_rank:02d}.safetensors")).items()}
        states[rank] = {"model": model, "optimizer": {}, "num_steps": 3}
        coords[rank] = RankCoords(tp_rank=tp_rank, cp_rank=0, dp_rank=dp_rank)
    return save_checkpoint(tmp_path / "checkpoints", 3, recipe="sft", role_layouts={"policy": layout},
                           role_states={"policy": states}, role_coords={"policy": coords}, driver_state={},
                           resolved_run_config={"model": {"hf_checkpoint": base}})


@pytest.mark.parametrize("tp_size, dp_size", [(1, 1), (2, 2)])
def test_export_merges_tp_shards_into_the_runs_own_weights(tmp_path, tp_size, dp_size):
    base = str(tmp_path / "base")
    save_tiny_hf_checkpoint(base, "llama", seed=0)  # vocab 101: TP=2 pads it
    step = _training_checkpoint(tmp_path, base, tp_size, dp_size, scale=2.0)
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
    step = _training_checkpoint(tmp_path, base, 1, 1, scale=1.0)
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
