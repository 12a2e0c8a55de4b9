"""End-to-end torchrun launch (slow): a real `stacx train` process per rank.

The other end-to-end launches have their own files so that two pytest workers can run them at
once: the demo (test_demo_end_to_end.py) and GRPO on a two-node Ray cluster, direct and through
`ray job submit` (tests/trainer/test_ray_multinode.py, which holds the two-node cluster fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stacx.tasks import write_tiny_checkpoint
from tests.warm import torchrun_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"})
    env.update(extra or {})
    return env


def _series(metrics_path: str, name: str) -> list[float]:
    with open(metrics_path) as handle:
        return [json.loads(line)[name] for line in handle]


def _sft_flags(checkpoint: str, out: str) -> list[str]:
    return ["--algorithm", "sft", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:sorting",
            "--rollout-batch-size", "16", "--lr", "3e-3", "--num-steps", "4", "--out", out, "--no-progress-bar", "--no-plots",
            "--save", os.path.join(out, "checkpoints")]


def _train_in_a_one_rank_world(groups, flags: list[str]) -> int:
    """`stacx train FLAGS` as torchrun's only rank would run it, in a forked one-rank gloo world."""
    from stacx.launch.cli import main

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # what torchrun sets: `stacx train` takes the SPMD path
    return main(["train", *flags])


@pytest.mark.distributed
def test_torchrun_sft_with_two_interleaved_pipeline_stages_matches_the_single_rank_loss_curve(tmp_path):
    """A real torchrun launch of two ranks, the model's 4 layers split into two pipeline stages of two
    virtual stages each (megatron's interleaved schedule: rank 0 holds layers 0 and 2), against the same
    command on one rank (forked in-process, the same `stacx train` entry point): the loss curves agree.
    (Two data-parallel ranks under torchrun: tests/launch/test_custom_code_on_every_rank.py; PP=2 without
    virtual stages: tests/parallel/test_pipeline.py and the PPO critic on Ray.)"""
    from stacx.testing.distributed import run_distributed

    checkpoint = write_tiny_checkpoint(str(tmp_path / "init"), "sorting", seed=0, num_layers=4)
    curves = {}
    for num_ranks in (1, 2):
        out = str(tmp_path / f"ranks{num_ranks}")
        flags = [*_sft_flags(checkpoint, out), "--pipeline-model-parallel-size", str(num_ranks)]
        if num_ranks == 2:
            flags += ["--num-layers-per-virtual-pipeline-stage", "1"]
        if num_ranks == 1:
            assert run_distributed(_train_in_a_one_rank_world, 1, args=(flags,)) == [0]
        else:
            completed = subprocess.run([*torchrun_command(), "--standalone", f"--nproc-per-node={num_ranks}", "-m", "stacx.train",
                                        *flags], env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
            assert completed.returncode == 0, completed.stderr[-4000:]
        curves[num_ranks] = _series(os.path.join(out, "metrics.jsonl"), "policy/loss")
        manifests = [name for name in os.listdir(os.path.join(out, "checkpoints")) if not name.startswith(".")]
        assert manifests, f"no checkpoint written under {out}/checkpoints"
    assert len(curves[1]) == 4 and curves[1][-1] < curves[1][0]
    # The same micro-batches through the interleaved stages: the loss is the one-stage loss (fp32, 1e-5 rel).
    assert curves[2] == pytest.approx(curves[1], rel=1e-5)
