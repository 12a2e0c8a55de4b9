"""--max-restarts on Ray, end to end: a GRPO run (the CPU engine's `stacx serve` beside the workers) whose
policy worker is killed right after the step-3 checkpoint of 6 (the test-only STACX_FAULT_KILL_AT_STEP hook)
restarts once from that checkpoint, ends at step 6, counts the restart in `run/restarts`, and its final
weights and its losses of steps 4-6 equal an uninterrupted run's bitwise (same seed, CPU path). Under
`stacx torchrun` (one launch, SFT, one rank killed after the step-2 checkpoint of 4): torch elastic restarts
the rank with the run's own --max-restarts, the restarted rank 0 takes the --save lock again, loads the
checkpoint itself and ends as an uninterrupted run of the same loop (in a forked gloo rank) does."""

from __future__ import annotations

import os
import subprocess
import sys

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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_STEPS = dict(num_steps=4, save_interval=2, lr=1e-3, rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=4)


def uninterrupted_sft(groups, root: str, policy: str, data: str):
    from stacx.trainer.spmd import run_spmd

    run_spmd(run_config(root, train={"algorithm": "sft"}, hf_checkpoint=policy, prompt_data=data,
                        save=os.path.join(root, "ckpt"), out=os.path.join(root, "out"), **SFT_STEPS))


def test_under_stacx_torchrun_a_killed_rank_is_restarted_by_torch_elastic_and_resumes_itself(files, tmp_path):
    from stacx.testing.distributed import run_distributed
    from tests.checkpointing.helpers import read_torch_dist_tensors

    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    run_distributed(uninterrupted_sft, 1, args=(str(straight), files["policy"], files["sft"]), timeout_s=300)
    flags = ["--algorithm", "sft", "--hf-checkpoint", files["policy"], "--prompt-data", files["sft"],
             "--max-tokens-per-micro-batch", "64", "--save", str(restarted / "ckpt"), "--out", str(restarted / "out"),
             "--no-progress-bar", "--no-tensorboard", "--no-plots", "--max-restarts", "1",
             *[f"--{name.replace('_', '-')}={value}" for name, value in SFT_STEPS.items()]]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", STACX_FAULT_KILL_AT_STEP="2")
    done = subprocess.run([sys.executable, "-m", "stacx", "torchrun", "--standalone", "--nproc-per-node", "1",
                           "-m", "stacx.train", *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "STACX_FAULT_KILL_AT_STEP=2: rank 0 kills itself" in log, log[-4000:]
    assert f"restart 1 (torch elastic) from checkpoint {restarted / 'ckpt' / 'step_000000002'}" in log, log[-4000:]
    rows, straight_rows = read_metrics(str(restarted / "out")), read_metrics(str(straight / "out"))
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert [row["run/restarts"] for row in rows] == [0.0, 0.0, 1.0, 1.0]
    assert [row["policy/loss"] for row in rows] == [row["policy/loss"] for row in straight_rows]
    a, b = (read_torch_dist_tensors(root / "ckpt" / "step_000000004" / "roles" / "policy" / "model")
            for root in (straight, restarted))
    assert a.keys() == b.keys() and a and all(torch.equal(a[name], b[name]) for name in a)
