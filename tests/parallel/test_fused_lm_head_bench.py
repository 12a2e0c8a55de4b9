"""bench/logprobs.py's lm-head section runs at a tiny size and reports what docs/performance.md quotes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "logprobs.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_logprobs", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lm_head_section_reports_fused_against_unfused(tmp_path):
    output = tmp_path / "logprobs.json"
    bench = load_bench()
    assert bench.main([
        "--section", "lm-head", "--vocab", "4096", "--lm-head-tokens", "64", "--hidden", "8",
        "--repeats", "1", "--output", str(output),
    ]) == 0
    result = json.loads(output.read_text())["fused_lm_head"]
    runs = result["runs"]
    assert set(runs) == {"fused_log_probs_entropy", "unfused_log_probs_entropy", "fused_log_probs", "unfused_log_probs"}
    # The unfused path holds the logits and their gradient (2x the shard); the fused one a few tiles.
    assert runs["unfused_log_probs_entropy"]["working_ratio_vs_logits_shard"] >= 1.9
    assert result["working_memory_ratio_vs_logits_shard"] < 0.5
    assert result["time_ratio_fused_vs_unfused"] > 0 and result["sizes"]["tile"] == [64, 256]
