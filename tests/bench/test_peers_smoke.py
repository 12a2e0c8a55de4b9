"""bench/peers/train_step_vs_trl.py --smoke: TRL's GRPOTrainer and Stacx run the same step and agree."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "peers" / "train_step_vs_trl.py"

# TRL is in the test extra (and the bench extra), so CI runs this comparison: no skip when it is missing.
assert importlib.util.find_spec("trl") is not None, "TRL is not installed: pip install -e '.[test]' (with torch pinned)"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_peers", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def leaves_no_world_behind():
    """The Stacx side builds a one-rank gloo world and the bench sets 2 threads: undo both."""
    import torch

    from stacx.parallel.groups import destroy_parallel_layout

    threads = torch.get_num_threads()
    yield
    destroy_parallel_layout()
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_smoke_run_compares_trl_and_stacx_steps(tmp_path, leaves_no_world_behind):
    output = tmp_path / "peers.json"
    assert load_bench().main(["--smoke", "--sizes", "S", "moe-S", "--skip-memory", "--generation",
                              "--out", str(output)]) == 0
    result = json.loads(output.read_text())
    assert [row["size"] for row in result["rows"]] == ["moe-smoke", "smoke"]  # a tiny Qwen3-MoE and a tiny Qwen2
    for row in result["rows"]:
        # warm-up + one timed round, each side's own step losses, agreeing step by step
        assert len(row["trl_steps"]) == len(row["stacx_steps"]) == 2
        assert row["trl_steps"][0]["loss"] != row["trl_steps"][1]["loss"]  # the optimizer moved the weights
        assert row["max_loss_rel_diff"] <= 1e-4 and row["max_grad_norm_rel_diff"] <= 1e-4
        assert row["ratio_tokens_per_s_stacx_over_trl"] == pytest.approx(row["trl_step_s"] / row["stacx_step_s"])
        assert 0 < row["trl_padding_fraction"] < 1
        assert "'fused': True" in row["optimizers"]["stacx"]  # the CPU step's AdamW is torch's fused kernel
    modes = {(g["mode"], g["new_tokens"]) for g in result["generation"]}
    assert modes == {("greedy", 8), ("sampled", 8)}
    assert all(g["max_abs_log_prob_error_vs_trainer"] <= 1e-5 for g in result["generation"])
