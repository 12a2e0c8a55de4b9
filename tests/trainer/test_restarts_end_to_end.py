"""--max-restarts on Ray, end to end: a GRPO run (the CPU engine's `stacx serve` beside the workers) whose
policy worker is killed right after the step-3 checkpoint of 6 (the test-only STACX_FAULT_KILL_AT_STEP hook)
restarts once from that checkpoint, ends at step 6, counts the restart in `run/restarts`, and its final
weights and its losses of steps 4-6 equal an uninterrupted run's bitwise (same seed, CPU path)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.trainer.training_fixtures import VARIED_REWARD, read_metrics, run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def _run(root, files, address: str, **values):
    from stacx.trainer.factory import create_trainer
    from stacx.trainer.restarts import run_with_restarts

    cfg = run_config(str(root), train={"algorithm": "grpo"}, hf_checkpoint=files["policy"], prompt_data=files["prompts"],
                     rollout_engine="cpu", reward_fn=VARIED_REWARD, num_steps=6, save_interval=3,
                     save=str(root / "ckpt"), ray_address=address, out=str(root / "out"), **values)
    return run_with_restarts(cfg, create_trainer)


def _weights(root) -> dict:
    from tests.checkpointing.helpers import read_torch_dist_tensors

    return read_torch_dist_tensors(root / "ckpt" / "step_000000006" / "roles" / "policy" / "model")


def test_a_worker_killed_after_a_checkpoint_restarts_from_it_and_ends_as_an_uninterrupted_run(
        ray_address, files, tmp_path, monkeypatch, capsys):
    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    _run(straight, files, ray_address)
    monkeypatch.setenv("STACX_FAULT_KILL_AT_STEP", "3")
    last = _run(restarted, files, ray_address, max_restarts=1)
    err = capsys.readouterr().err
    assert "STACX_FAULT_KILL_AT_STEP=3: killing role 'policy' rank 0" in err
    assert "restart 1 of --max-restarts 1 from checkpoint" in err and "step_000000003" in err
    assert "worker role 'policy' rank 0 died" in err
    assert last["run/restarts"] == 1.0
    rows, straight_rows = read_metrics(str(restarted / "out")), read_metrics(str(straight / "out"))
    assert [row["step"] for row in rows] == list(range(6))
    assert [row["run/restarts"] for row in rows] == [0.0] * 3 + [1.0] * 3
    assert [row["policy/loss"] for row in rows] == [row["policy/loss"] for row in straight_rows]
    a, b = _weights(straight), _weights(restarted)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
