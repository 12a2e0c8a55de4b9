"""Checkpoints: atomic commit, manifest, crash safety, exact resume, layout and recipe validation."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from stacx.trainer import checkpoint as ckpt
from stacx.trainer.checkpoint import (
    CheckpointError,
    RankCoords,
    RoleLayout,
    begin_checkpoint,
    capture_rng_state,
    commit_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
    write_rank_state,
)

POLICY_TP2 = RoleLayout(tensor_model_parallel_size=2, context_parallel_size=1, data_parallel_size=1)
CRITIC_DP2 = RoleLayout(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=2)
LAYOUTS = {"policy": POLICY_TP2, "critic": CRITIC_DP2}


@dataclass(frozen=True)
class _RunConfig:
    lr: float
    urls: tuple[str, ...]
    specialization: type


def _states(seed: int) -> dict[str, dict[int, dict]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        role: {rank: {"model": {"weight": torch.randn(3, 4, generator=generator)}, "optimizer": {"step": rank}}
               for rank in range(layout.world_size)}
        for role, layout in LAYOUTS.items()
    }


def _save(root, step, seed=0, recipe="ppo"):
    return save_checkpoint(root, step, recipe=recipe, role_layouts=LAYOUTS, role_states=_states(seed),
                           driver_state={"data_position": step * 8, "epoch": 0},
                           resolved_run_config=_RunConfig(lr=1e-5, urls=("a", "b"), specialization=RoleLayout))


def test_save_writes_manifest_with_layouts_sizes_and_hashes_and_loads_back(tmp_path):
    folder = _save(tmp_path, 3, seed=1)
    assert Path(folder).name == "step_000000003" and latest_checkpoint(tmp_path) == folder
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["recipe"] == "ppo"
    assert manifest["roles"]["policy"]["layout"]["tensor_model_parallel_size"] == 2
    assert [e["rank"] for e in manifest["roles"]["critic"]["ranks"]] == [0, 1]
    for role in manifest["roles"].values():
        for entry in role["ranks"]:
            on_disk = Path(folder) / entry["path"]
            assert on_disk.stat().st_size == entry["size"]
            assert ckpt._sha256(on_disk) == entry["sha256"]
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith(".")], "no staging folder left behind"

    loaded = load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts=LAYOUTS)
    assert loaded.step == 3 and loaded.path == folder
    expected = _states(1)
    for role, states in expected.items():
        for rank, state in states.items():
            got = loaded.rank_state(role, rank)
            assert torch.equal(got["model"]["weight"], state["model"]["weight"])
            assert got["optimizer"] == state["optimizer"]
    assert loaded.driver_state() == {"data_position": 24, "epoch": 0}
    assert loaded.run_config() == {"lr": 1e-5, "urls": ["a", "b"],
                                   "specialization": "stacx.trainer.config.layout.RoleLayout"}


def test_half_written_staging_folder_is_ignored_and_a_crash_in_commit_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = _save(tmp_path, 1)
    # A crash after some workers wrote their files: a staging folder with no manifest.
    staging = begin_checkpoint(tmp_path, 2)
    write_rank_state(staging, "policy", 0, {"model": {}})
    # A folder with a step name but no manifest (e.g. copied by hand, interrupted) is not complete either.
    (Path(tmp_path) / "step_000000005").mkdir()
    assert latest_checkpoint(tmp_path) == first
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]

    # A crash at the final rename: nothing new becomes visible.
    real_rename = os.rename

    def crash_on_commit(src, dst):
        if Path(dst).name == "step_000000002":
            raise OSError("simulated crash")
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash_on_commit)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2)
    monkeypatch.setattr(ckpt.os, "rename", real_rename)
    assert latest_checkpoint(tmp_path) == first
    loaded = load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts=LAYOUTS)
    assert loaded.step == 1

    # Pruning removes stale staging folders from dead writers but keeps complete checkpoints.
    os.rename(staging, Path(tmp_path) / ".staging-step_000000002-999999999-deadbeef")
    second = _save(tmp_path, 2)
    removed = prune_checkpoints(tmp_path, keep_last=1)
    assert first in removed and latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["step_000000002", "step_000000005"]


def test_commit_requires_every_rank_of_every_role(tmp_path):
    staging = begin_checkpoint(tmp_path, 4)
    files = [write_rank_state(staging, "policy", 0, {"model": {}})]  # rank 1 of tp=2 never reported
    with pytest.raises(CheckpointError, match=r"role 'policy': expected files from ranks 0..1 .*got ranks \[0\]"):
        commit_checkpoint(staging, step=4, recipe="grpo", role_layouts={"policy": POLICY_TP2}, rank_files=files,
                          driver_state={}, resolved_run_config={})
    assert latest_checkpoint(tmp_path) is None


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 2, seed=1)
    _save(tmp_path, 2, seed=2)
    loaded = load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts=LAYOUTS)
    assert torch.equal(loaded.rank_state("policy", 0)["model"]["weight"], _states(2)["policy"][0]["model"]["weight"])
    assert [p.name for p in Path(tmp_path).iterdir()] == ["step_000000002"]


def test_load_rejects_other_recipe_missing_role_old_format_and_corruption(tmp_path):
    folder = _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"saved by recipe 'ppo'; this run uses 'grpo'"):
        load_checkpoint(tmp_path, expected_recipe="grpo", expected_layouts={"policy": POLICY_TP2})
    with pytest.raises(CheckpointError, match=r"no state for roles \['reward_model'\]"):
        load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts={**LAYOUTS, "reward_model": CRITIC_DP2})
    tp4 = RoleLayout(tensor_model_parallel_size=4, context_parallel_size=1, data_parallel_size=1)
    # Another tp is no reason to refuse: the weights are torch_dist and reshard (tests/checkpointing).
    assert load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts={"policy": tp4}).layout_changed("policy")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint"):
        load_checkpoint(tmp_path / "empty", expected_recipe="ppo", expected_layouts=LAYOUTS)

    manifest_path = Path(folder) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(CheckpointError, match=r"format version 1 \(one torch.save pickle per rank\) was written by an "
                                              r"older Stacx.*Resume it with the Stacx version that wrote it"):
        load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts=LAYOUTS)
    manifest_path.write_text(json.dumps(manifest))

    rank_file = Path(folder) / "roles" / "critic" / "rank_00001.pt"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    rank_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00001.pt does not match its sha256"):
        load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts=LAYOUTS)
    rank_file.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match=r"rank_00001.pt has \d+ bytes, the manifest says"):
        load_checkpoint(tmp_path, expected_recipe="ppo", expected_layouts=LAYOUTS, verify_hashes=False)


def test_a_layout_change_takes_each_ranks_small_state_from_its_grid_position_or_rank_0(tmp_path):
    saved = RoleLayout(tensor_model_parallel_size=2, context_parallel_size=1, data_parallel_size=2)
    # Megatron's rank order is tp fastest, then cp, then dp.
    coords = {rank: RankCoords(tp_rank=rank % 2, cp_rank=0, dp_rank=rank // 2) for rank in range(4)}
    states = {rank: {"model": {"shard": torch.full((2,), float(rank % 2))}} for rank in range(4)}
    save_checkpoint(tmp_path, 1, recipe="grpo", role_layouts={"policy": saved}, role_states={"policy": states},
                    role_coords={"policy": coords}, driver_state={}, resolved_run_config={})
    bigger = RoleLayout(tensor_model_parallel_size=2, context_parallel_size=2, data_parallel_size=3)
    loaded = load_checkpoint(tmp_path, expected_recipe="grpo", expected_layouts={"policy": bigger})
    for tp_rank in range(2):
        state = loaded.rank_state("policy", 5, RankCoords(tp_rank=tp_rank, cp_rank=1, dp_rank=2))
        assert torch.equal(state["model"]["shard"], torch.full((2,), float(tp_rank)))

    # Same grid position (tp 1, cp 0, dp 1) under tp=4: saved rank 3; a position the save never had: rank 0.
    tp4 = RoleLayout(tensor_model_parallel_size=4, context_parallel_size=1, data_parallel_size=2)
    loaded = load_checkpoint(tmp_path, expected_recipe="grpo", expected_layouts={"policy": tp4})
    assert torch.equal(loaded.rank_state("policy", 5, RankCoords(tp_rank=1, cp_rank=0, dp_rank=1))["model"]["shard"],
                       torch.full((2,), 1.0))
    assert torch.equal(loaded.rank_state("policy", 3, RankCoords(tp_rank=3, cp_rank=0, dp_rank=0))["model"]["shard"],
                       torch.full((2,), 0.0))


def _draws() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(2).tolist())


def test_rng_state_round_trips_exactly_through_a_checkpoint(tmp_path):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    _draws()
    save_checkpoint(tmp_path, 1, recipe="sft", role_layouts={"policy": CRITIC_DP2},
                    role_states={"policy": {0: {"rng": capture_rng_state()}, 1: {"rng": capture_rng_state()}}},
                    driver_state={"rng": capture_rng_state()}, resolved_run_config={})
    after_save = [_draws() for _ in range(3)]
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    loaded = load_checkpoint(tmp_path, expected_recipe="sft", expected_layouts={"policy": CRITIC_DP2})
    restore_rng_state(loaded.rank_state("policy", 1)["rng"])
    assert [_draws() for _ in range(3)] == after_save
    restore_rng_state(loaded.driver_state()["rng"])
    assert [_draws() for _ in range(3)] == after_save


def _train(model, optimizer, scheduler, steps: int) -> None:
    # Dropout makes the result depend on the torch RNG, so an unrestored RNG would change the weights.
    for _ in range(steps):
        inputs = torch.randn(8, 6)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def _fresh():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return model, optimizer, scheduler


def test_two_steps_save_resume_two_steps_equals_four_steps_straight(tmp_path):
    model, optimizer, scheduler = _fresh()
    _train(model, optimizer, scheduler, 4)
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, optimizer, scheduler = _fresh()
    _train(model, optimizer, scheduler, 2)
    layout = RoleLayout(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1)
    save_checkpoint(tmp_path, 2, recipe="sft", role_layouts={"policy": layout}, driver_state={"step": 2},
                    role_states={"policy": {0: {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                "scheduler": scheduler.state_dict(), "rng": capture_rng_state()}}},
                    resolved_run_config={"lr": 1e-2})
    torch.manual_seed(999)  # the resuming process starts from a different RNG state

    model, optimizer, scheduler = _fresh()
    state = load_checkpoint(tmp_path, expected_recipe="sft", expected_layouts={"policy": layout}).rank_state("policy", 0)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"])
    _train(model, optimizer, scheduler, 2)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, straight[name]), name  # bitwise: same ops, same order, same RNG


def test_unsaveable_run_config_value_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"run config value .* of type object"):
        save_checkpoint(tmp_path, 1, recipe="sft", role_layouts={}, role_states={}, driver_state={},
                        resolved_run_config={"x": object()})
    assert list_checkpoints(tmp_path) == [] and not list(Path(tmp_path).iterdir())


def test_resume_with_a_changed_recipe_structure_names_the_changed_fields(tmp_path):
    from dataclasses import replace

    from stacx.trainer.recipes import TRAINING_CONFIGS

    grpo = TRAINING_CONFIGS["grpo"]
    layout = RoleLayout(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1)
    save_checkpoint(tmp_path, 1, recipe=grpo, role_layouts={"policy": layout}, role_states={"policy": {0: {}}},
                    driver_state={}, resolved_run_config={})
    loaded = load_checkpoint(tmp_path, expected_recipe=grpo, expected_layouts={"policy": layout})
    assert loaded.recipe_spec["roles"][0]["specialization_cls"] == "stacx.specializations.actor.ActorSpecialization"
    changed = replace(grpo, algorithm=replace(grpo.algorithm, clip_ratio_high=0.28))
    with pytest.raises(CheckpointError, match=r"recipe 'grpo' has changed .*algorithm\.clip_ratio_high"):
        load_checkpoint(tmp_path, expected_recipe=changed, expected_layouts={"policy": layout})
    # By name only, the structure is not compared.
    assert load_checkpoint(tmp_path, expected_recipe="grpo", expected_layouts={"policy": layout}).step == 1


def test_rank_file_info_survives_pickling_to_the_driver(tmp_path):
    import pickle

    staging = begin_checkpoint(tmp_path, 0)
    info = write_rank_state(staging, "policy", 0, {"w": torch.ones(2)}, RankCoords(tp_rank=0, cp_rank=0, dp_rank=0))
    assert pickle.loads(pickle.dumps(info)) == info
