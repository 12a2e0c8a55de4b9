"""The torchrun SPMD path trains and checkpoints over 2 gloo ranks without Stacx unpickling peer data.

Every rank wraps torch's object-collective unpickler (`distributed_c10d._unpickler`, what
`broadcast_object_list` / `all_gather_object` use) before `run_spmd`: a call made from Stacx's own
code fails the run; a call from megatron-core (its optimizer aligns parameter groups with
`all_gather_object`, see docs/security.md "Known gaps") is recorded, which also shows that the guard
sees object collectives at all. The run shares its batches, metrics, coordinates, checkpoint staging
folder and rank-file records regardless.
"""

from __future__ import annotations

import math
import os
import traceback

import pytest

from stacx.testing.distributed import run_distributed
from tests.trainer.training_fixtures import read_metrics, run_config, write_tiny_run_files

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]

TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
STACX_PACKAGE = os.sep + "stacx" + os.sep


def _guard_object_collectives(unpickled_for: list[str]) -> None:
    """Refuse torch's object-collective unpickling when Stacx code asked for it; record other callers."""
    import torch.distributed.distributed_c10d as c10d

    real_unpickler = c10d._unpickler

    def guarded(file):
        caller = next(frame for frame in reversed(traceback.extract_stack()[:-1])
                      if TORCH_DISTRIBUTED not in frame.filename)
        if STACX_PACKAGE in caller.filename and os.sep + "tests" + os.sep not in caller.filename:
            raise AssertionError(f"Stacx unpickled peer data: {caller.filename}:{caller.lineno} ({caller.name})")
        unpickled_for.append(caller.filename)
        return real_unpickler(file)

    c10d._unpickler = guarded


def train_sft_with_guarded_unpickling(groups, root: str):
    from stacx.trainer.spmd import run_spmd

    unpickled_for: list[str] = []
    _guard_object_collectives(unpickled_for)
    values = dict(train={"algorithm": "sft"}, hf_checkpoint=os.path.join(root, "policy"),
                  prompt_data=os.path.join(root, "sft.jsonl"), rollout_batch_size=4, num_steps=2,
                  out=os.path.join(root, "out"), save=os.path.join(root, "ckpt"))
    last = run_spmd(run_config(root, **values))
    return last, unpickled_for, os.environ.get("GLOO_SOCKET_IFNAME")


def test_sft_on_two_ranks_shares_and_gathers_without_pickle(tmp_path):
    root = str(tmp_path)
    write_tiny_run_files(root)
    (last_0, unpickled_for, interface), (last_1, _, _) = run_distributed(train_sft_with_guarded_unpickling, 2, args=(root,),
                                                          timeout_s=300)
    assert interface == "lo"  # MASTER_ADDR is 127.0.0.1: gloo/NCCL are pointed at loopback
    # The guard is live: megatron-core's own all_gather_object went through it (and was let pass).
    assert any("megatron" in filename for filename in unpickled_for), unpickled_for
    # Every rank got rank 0's results (the step time is each rank's own clock).
    assert {k: v for k, v in last_0.items() if k != "time/step_s"} == {k: v for k, v in last_1.items()
                                                                       if k != "time/step_s"}
    last = [last_0]
    assert math.isfinite(last[0]["policy/loss"])
    assert len(read_metrics(os.path.join(root, "out"))) == 2
    # The committed checkpoint lists both ranks' files (records gathered from rank 1 without pickle).
    assert any(name.startswith("step_") or name.startswith("iter_") for name in os.listdir(os.path.join(root, "ckpt")))
