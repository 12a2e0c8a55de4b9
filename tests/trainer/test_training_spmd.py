"""The torchrun SPMD path: SFT over 2 gloo ranks matches one rank step by step (2 mini-batches, so 2
optimizer steps, per rollout step); resume guards.

Each rank runs `run_spmd` (the same StacxTrainer loop as a Ray run, with LocalRoleGroup); the
reference is the same run on a world of one, whose checkpoint is also the one
test_checkpoint_security.py checks loads with torch's defaults alone.
"""

from __future__ import annotations

import math
import os

import pytest

from stacx.testing.distributed import run_distributed
from tests.trainer.test_checkpoint_security import assert_a_real_training_checkpoint_needs_nothing_beyond_torchs_defaults
from tests.trainer.training_fixtures import read_metrics, run_config, write_tiny_run_files

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]


def train_sft_spmd(groups, root: str, out_name: str, num_steps: int, extra: dict):
    from stacx.trainer.spmd import run_spmd

    paths = {"policy": os.path.join(root, "policy"), "sft": os.path.join(root, "sft.jsonl")}
    values = dict(train={"algorithm": "sft"}, hf_checkpoint=paths["policy"], prompt_data=paths["sft"],
                  rollout_batch_size=4, num_steps=num_steps, num_steps_per_rollout=2, out=os.path.join(root, out_name),
                  **extra)
    last = run_spmd(run_config(root, **values))
    return last


def dpo_runs(groups, root: str):
    """A DPO run told to resume an SFT checkpoint fails naming both recipes; a fresh one trains a step
    (pairs packed together, reference log-probs from the in-worker reference)."""
    from stacx.trainer.spmd import run_spmd

    values = dict(train={"algorithm": "dpo"}, hf_checkpoint=os.path.join(root, "policy"),
                  ref_load=os.path.join(root, "policy"), prompt_data=os.path.join(root, "dpo.jsonl"),
                  out=os.path.join(root, "out_dpo"), num_steps=1)
    try:
        run_spmd(run_config(root, load=os.path.join(root, "ckpt_dp1"), **values))
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        message = f"{type(err).__name__}: {err}"
    else:
        message = "no error"
    return message, run_spmd(run_config(root, **values))


def test_sft_two_ranks_match_one_rank_loss_curve(tmp_path):
    root = str(tmp_path)
    write_tiny_run_files(root)
    single = run_distributed(train_sft_spmd, 1, args=(root, "out_dp1", 3, {"save": os.path.join(root, "ckpt_dp1")}))
    double = run_distributed(train_sft_spmd, 2, args=(root, "out_dp2", 3, {}))
    rows_1 = read_metrics(os.path.join(root, "out_dp1"))
    curve_1 = [row["policy/loss"] for row in rows_1]
    curve_2 = [row["policy/loss"] for row in read_metrics(os.path.join(root, "out_dp2"))]
    assert len(curve_1) == len(curve_2) == 6  # 3 rollout steps x 2 mini-batches of 2 rows
    assert [(row["step"], row["rollout_step"]) for row in rows_1] == [(i, i // 2) for i in range(6)]
    assert all(math.isfinite(x) for x in curve_1)
    # Same mini-batches, split over 2 DP ranks: the reduction contract (each mini-batch normalized by its
    # own global counts) makes every optimizer step's loss (and gradient) equal up to float32 summation order.
    assert curve_2 == pytest.approx(curve_1, rel=1e-5, abs=1e-6)
    assert curve_1[-1] < curve_1[0]  # lr 1e-3 on 8 examples: the loss goes down
    assert double[0]["policy/loss"] == pytest.approx(double[1]["policy/loss"])  # every rank sees the metrics
    assert single[0]["policy/num_loss_tokens"] == double[0]["policy/num_loss_tokens"]
    # The one-rank run's checkpoint needs nothing beyond torch's defaults to load (the check of
    # test_checkpoint_security.py's former one-rank SFT run, folded here): 3 rollout steps of 2 optimizer steps.
    assert_a_real_training_checkpoint_needs_nothing_beyond_torchs_defaults(os.path.join(root, "ckpt_dp1"),
                                                                           rollout_steps=3, optimizer_steps=6)

    message, dpo_metrics = run_distributed(dpo_runs, 1, args=(root,))[0]
    assert "CheckpointError" in message and "'sft'" in message and "'dpo'" in message, message
    # Policy == reference at the first step: every implicit reward margin is 0 and the loss is log 2.
    assert dpo_metrics["policy/loss"] == pytest.approx(math.log(2), rel=1e-5)
