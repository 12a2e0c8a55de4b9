"""--max-restarts on Ray, end to end, in one LoRA run: `stacx train` (in this process, attached to the shared
Ray cluster; the CPU engine's `stacx serve` beside the workers) of GRPO with the KL loss (the reference is the base
with the adapters off) and --lora-sync adapters, whose policy worker is killed right after the step-2 checkpoint of
4 (the test-only STACX_FAULT_KILL_AT_STEP hook). It restarts once from that checkpoint (`--load`, the resume path),
ends at step 4, counts the restart in `run/restarts`, and its final weights (base and adapters) and its losses of
steps 3-4 equal an uninterrupted LoRA run's bitwise (same seed, CPU path); its last checkpoint is exported as a PEFT
adapter folder and as merged weights with `stacx convert checkpoint-to-hf --lora`.
Under `stacx torchrun` (one launch, SFT, one rank killed after the step-2 checkpoint of 4): torch elastic restarts
the rank with the run's own --max-restarts, the restarted rank 0 takes the --save lock again, loads the
checkpoint itself and ends as an uninterrupted run of the same loop (in a forked gloo rank) does."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.trainer.training_fixtures import VARIED_REWARD, read_metrics, run_config
from tests.warm import warm_python

pytestmark = [pytest.mark.usefixtures("warm_engine_servers"),  # the in-process drivers' engines start warm
              pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "linear_qkv",
              "--lora-target-modules", "linear_fc2", "--lora-sync", "adapters"]


def _train_lora_grpo(root, files, address: str, *extra: str) -> list[dict]:
    """`stacx train` (the command's own code, in this process: it is the Ray driver) of a 4-step LoRA GRPO run
    saving every 2 steps under `root`; the metrics of its steps."""
    from stacx.launch.cli import main

    flags = ["train", "--algorithm", "grpo", "--hf-checkpoint", files["policy"], "--ref-load", files["policy"],
             "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-2", *LORA_FLAGS,
             "--prompt-data", files["prompts"], "--rollout-engine", "cpu", "--reward-fn", VARIED_REWARD,
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
             "--max-tokens-per-micro-batch", "64", "--num-steps", "4", "--save-interval", "2",
             "--save", str(root / "ckpt"), "--out", str(root / "out"), "--collective-timeout-s", "120",
             "--no-plots", "--no-progress-bar", "--no-tensorboard", "--ray-address", address, *extra]
    assert main(flags) == 0
    return read_metrics(str(root / "out"))


def _weights(root) -> dict:
    from tests.checkpointing.helpers import read_torch_dist_tensors

    return read_torch_dist_tensors(root / "ckpt" / "step_000000004" / "roles" / "policy" / "model")


def test_a_lora_worker_killed_after_a_checkpoint_restarts_from_it_ends_as_an_uninterrupted_run_and_exports_peft(
        ray_address, files, tmp_path, monkeypatch, capsys):
    from stacx.launch.cli import main

    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    straight_rows = _train_lora_grpo(straight, files, ray_address)
    # Each step sampled from the adapters pushed after the one before, which the engine merged and confirmed.
    assert [row["rollout/weight_version"] for row in straight_rows] == [float(step) for step in range(4)]
    assert all(row["policy/grad_norm"] > 0 for row in straight_rows)  # the adapters' gradients (the base has none)
    # The reference is the base with the adapters off: equal to the policy at step 0 (B = 0), not after a step.
    assert straight_rows[0]["policy/kl_loss"] == 0.0 and straight_rows[1]["policy/kl_loss"] > 0.0
    capsys.readouterr()

    monkeypatch.setenv("STACX_FAULT_KILL_AT_STEP", "2")
    rows = _train_lora_grpo(restarted, files, ray_address, "--max-restarts", "1")
    err = capsys.readouterr().err
    assert "STACX_FAULT_KILL_AT_STEP=2: killing role 'policy' rank 0" in err
    assert "restart 1 of --max-restarts 1 from checkpoint" in err and "step_000000002" in err
    assert "worker role 'policy' rank 0 died" in err
    assert [row["step"] for row in rows] == list(range(4))
    assert [row["run/restarts"] for row in rows] == [0.0] * 2 + [1.0] * 2
    # The restarted generation resumed the adapters and the engine's version from the checkpoint (`--load`).
    assert [row["rollout/weight_version"] for row in rows] == [float(step) for step in range(4)]
    assert all(row["policy/grad_norm"] > 0 for row in rows)
    assert [row["policy/loss"] for row in rows] == [row["policy/loss"] for row in straight_rows]
    a, b = _weights(straight), _weights(restarted)
    assert a.keys() == b.keys() and a
    assert any("lora" in name for name in a), sorted(a)  # the adapters are in the checkpoint, compared too
    for name in a:
        assert torch.equal(a[name], b[name]), name

    # The exports, through the command's own code in this process (a subprocess would pay torch's start-up again).
    for mode, expected in (("adapter", "adapter_config.json"), ("merged", "config.json")):
        out = str(tmp_path / f"export_{mode}")
        command = ["convert", "checkpoint-to-hf", "--load", str(restarted / "ckpt"), "--lora", mode, "--out", out]
        assert main(command) == 0
        assert os.path.isfile(os.path.join(out, expected))
    config = json.load(open(tmp_path / "export_adapter" / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "down_proj"}


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
    done = subprocess.run([warm_python(), "-m", "stacx", "torchrun", "--standalone", "--nproc-per-node", "1",
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
