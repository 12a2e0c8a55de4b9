"""`--ref-load` and `--load` take a torch_dist model folder as well as a Hugging Face one (detected)."""

from __future__ import annotations

import math
import os

import pytest

from stacx.testing.distributed import run_distributed
from tests.trainer.training_fixtures import read_metrics, run_config, write_tiny_run_files

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def dpo_from_torch_dist(groups, root: str, dist_dir: str):
    from stacx.trainer.spmd import run_spmd

    values = dict(train={"algorithm": "dpo"}, hf_checkpoint=os.path.join(root, "policy"), ref_load=dist_dir,
                  load=dist_dir, prompt_data=os.path.join(root, "dpo.jsonl"), out=os.path.join(root, "out"),
                  num_steps=1)
    return run_spmd(run_config(root, **values))


def test_dpo_takes_reference_and_start_weights_from_a_torch_dist_folder(tmp_path, capfd):
    from stacx.checkpointing.convert import convert_hf_to_torch_dist

    root = str(tmp_path)
    files = write_tiny_run_files(root)
    dist_dir = convert_hf_to_torch_dist(files["teacher"], os.path.join(root, "teacher_torch_dist"))
    run_distributed(dpo_from_torch_dist, 1, args=(root, dist_dir), timeout_s=400)
    (row,) = read_metrics(os.path.join(root, "out"))
    # The policy starts from --load and the reference is --ref-load: the same weights, so every
    # log-ratio is 0 and the first DPO loss is -log(sigmoid(0)) = log 2. The --hf-checkpoint policy
    # (another seed) would give something else.
    assert row["policy/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert "starts from the weights of --load" in capfd.readouterr().out
