"""Resuming never runs code from a checkpoint: planted pickle payloads are refused naming the file,
and a real training checkpoint (megatron optimizer and scheduler, RNG, data position) loads with
`torch.load(weights_only=True)` and nothing added to its allow-list (checked on the checkpoint
tests/trainer/test_training_spmd.py's one-rank SFT run saves, which needs no run of its own here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from stacx.trainer import checkpoint as ckpt
from stacx.trainer.checkpoint import (
    CHECKPOINT_SAFE_GLOBALS,
    CheckpointError,
    RoleLayout,
    load_checkpoint,
    save_checkpoint,
)

LAYOUT = RoleLayout(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1)


class PlantedPayload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(folder: Path, relative: str, value) -> None:
    """Replace one file of a checkpoint and rewrite the manifest to match, as an attacker with write access would."""
    path = folder / relative
    torch.save(value, path)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entries = [entry for role in manifest["roles"].values() for entry in role["ranks"]] + [manifest["driver_state"]]
    for entry in entries:
        if entry["path"] == relative:
            entry["size"], entry["sha256"] = path.stat().st_size, ckpt._sha256(path)
    manifest_path.write_text(json.dumps(manifest))


def _checkpoint(root: Path) -> Path:
    return Path(save_checkpoint(root, 1, recipe="sft", role_layouts={"policy": LAYOUT},
                                role_states={"policy": {0: {"model": {"w": torch.ones(2)}}}},
                                driver_state={"step": 1}, resolved_run_config={}))


@pytest.mark.parametrize("relative", ["roles/policy/rank_00000.pt", "driver.pt"])
def test_a_planted_pickle_payload_is_refused_naming_the_file_and_never_runs(tmp_path, relative):
    folder = _checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "planted-code-ran"
    _plant(folder, relative, {"model": {"w": torch.ones(2)}, "optimizer": PlantedPayload(str(marker))})
    loaded = load_checkpoint(folder, expected_recipe="sft", expected_layouts={"policy": LAYOUT})  # hashes match
    with pytest.raises(CheckpointError, match=rf"checkpoint file {folder / relative} holds an object that Stacx "
                                              r"refuses to unpickle \(.*system.*\).*Do not resume from it"):
        loaded.rank_state("policy", 0) if relative.startswith("roles") else loaded.driver_state()
    assert not marker.exists()


def test_the_allow_list_admits_only_what_is_listed(tmp_path):
    # A plain data class that is not on the list is refused too: nothing outside torch's defaults gets in.
    path = tmp_path / "state.pt"
    torch.save({"layout": LAYOUT}, path)
    with pytest.raises(CheckpointError, match="RoleLayout"):
        ckpt.load_state_file(path)
    assert CHECKPOINT_SAFE_GLOBALS == ()


def assert_a_real_training_checkpoint_needs_nothing_beyond_torchs_defaults(folder: str, *, rollout_steps: int,
                                                                           optimizer_steps: int) -> None:
    """One SFT rank with megatron's DDP, optimizer and scheduler saved `folder`; every .pt file (Stacx's and
    torch_dist's common.pt) loads with weights_only=True and an empty allow-list, and the torch_dist folder holds
    the optimizer state resume restores. Made on the one-rank run of
    tests/trainer/test_training_spmd.py::test_sft_two_ranks_match_one_rank_loss_curve (Session 10: this file's
    own one-rank SFT run, the same run with one step fewer, was folded into it)."""
    files = sorted(Path(folder).rglob("*.pt"))
    assert {f.name for f in files} == {"driver.pt", "rank_00000.pt", "common.pt"}
    for path in files:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == [], path
    loaded = load_checkpoint(Path(folder), expected_recipe="sft", expected_layouts={"policy": LAYOUT})
    state = loaded.rank_state("policy", 0)
    # The scheduler counts optimizer steps (several per rollout step with mini-batches), not rollout steps.
    assert state["num_steps"] == optimizer_steps and state["scheduler"]["num_steps"] == optimizer_steps
    from tests.checkpointing.helpers import read_torch_dist_tensors

    saved = read_torch_dist_tensors(loaded.model_folder("policy"))
    assert any(key.startswith("optimizer.state.exp_avg.") for key in saved)
    assert loaded.driver_state()["step"] == loaded.step == rollout_steps
