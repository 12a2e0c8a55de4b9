"""A LoRA GRPO run through `stacx train` on Ray (the shared test cluster), saved, resumed and exported.

GRPO with the KL loss (the reference is the base model with the adapters off; a length reward, so the advantages
and the adapters' gradients are not zero) and --lora-sync adapters: the CPU
engine's `stacx serve` is started with the run's --lora-* flags and receives only the adapters after each step. The
run is resumed from its --save folder for a third step, then its policy is exported as a PEFT adapter folder and as
merged weights with `stacx convert checkpoint-to-hf --lora`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch.test_custom_code_on_every_rank import REPO, SMALL_ROLLOUT, tiny_checkpoint, train_env  # noqa: F401

LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "linear_qkv",
              "--lora-target-modules", "linear_fc2",
              "--lora-sync", "adapters"]


def _train(flags: list[str], out: str, num_steps: int, ray_address: str) -> list[dict]:
    """`stacx train` attached to the shared Ray cluster; the metrics of the steps this launch ran."""
    command = [sys.executable, "-m", "stacx.train", *flags, "--num-steps", str(num_steps), "--out", out, "--no-plots",
               "--ray-address", ray_address]
    completed = subprocess.run(command, env=train_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-5000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_grpo_on_ray_saves_resumes_and_exports_peft(tiny_checkpoint, tmp_path, shared_ray_address):
    saved = str(tmp_path / "checkpoints")
    flags = ["--algorithm", "grpo", "--hf-checkpoint", tiny_checkpoint, "--ref-load", tiny_checkpoint,
             "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-2", *LORA_FLAGS, *SMALL_ROLLOUT, "--save", saved,
             "--reward-fn", "tests/launch/constant_reward.py:response_length"]
    steps = _train(flags, str(tmp_path / "out"), 2, shared_ray_address)
    # Step 1 sampled from the adapters pushed after step 0, which the engine merged and confirmed.
    assert [step["rollout/weight_version"] for step in steps] == [0.0, 1.0]
    assert all(step["policy/grad_norm"] > 0 for step in steps)  # the adapters' gradients (the base has none)
    # The reference is the base with the adapters off: equal to the policy at step 0 (B = 0), not after a step.
    assert steps[0]["policy/kl_loss"] == 0.0 and steps[1]["policy/kl_loss"] > 0.0
    resumed = _train([*flags, "--load", saved], str(tmp_path / "resumed"), 3, shared_ray_address)
    assert [step["step"] for step in resumed] == [2] and resumed[0]["rollout/weight_version"] == 2.0
    for mode, expected in (("adapter", "adapter_config.json"), ("merged", "config.json")):
        out = str(tmp_path / f"export_{mode}")
        completed = subprocess.run(
            [sys.executable, "-m", "stacx", "convert", "checkpoint-to-hf", "--load", saved, "--lora", mode,
             "--out", out], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert os.path.isfile(os.path.join(out, expected))
    config = json.load(open(tmp_path / "export_adapter" / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "down_proj"}
