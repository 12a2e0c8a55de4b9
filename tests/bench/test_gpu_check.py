"""scripts/gpu_check.sh --dry-run: the GPU check's own logic on CPU at tiny sizes, and its JSON check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.warm import warm_python

ROOT = Path(__file__).resolve().parents[2]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_run_writes_every_section_and_passes_its_own_check(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHON=warm_python())
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{out}: OK" in run.stdout
    result = json.loads(out.read_text())
    assert result["mode"] == "dry_run" and set(result["sections"]) == {"parity", "train", "logprobs"}
    parity, train, logprobs = (result["sections"][name] for name in ("parity", "train", "logprobs"))
    assert parity["passed"] and 0 < parity["relative_max_logit_error"] <= parity["tolerance"]
    assert train["tokens_per_s"] > 0 and train["mfu"] == pytest.approx(train["achieved_tflops"] / result["peak_tflops"])
    runs = logprobs["runs"]
    assert runs["megatron"]["time_ratio_vs_megatron"] == 1.0
    # the fused path never builds the [T, V] logits: less peak memory than both paths that do
    assert runs["stacx_fused"]["peak_extra_bytes"] < runs["stacx_unfused"]["peak_extra_bytes"]
    assert runs["stacx_fused"]["peak_extra_bytes"] < runs["megatron"]["peak_extra_bytes"]


def test_check_names_a_failed_section_and_a_failed_parity():
    gpu_check = load_gpu_check()
    result = {"mode": "gpu", "device": "x", "peak_tflops": 790.0, "torch": "2.11",
              "sections": {"parity": {"passed": False, "relative_max_logit_error": 0.5, "tolerance": 0.03},
                           "train": {"error": "Traceback ...\nRuntimeError: CUDA out of memory"}}}
    problems = gpu_check.check_result(result)
    assert any("'train' failed: RuntimeError: CUDA out of memory" in p for p in problems)
    assert any("parity: relative logit error 0.5" in p for p in problems)
    assert any("'logprobs' is missing" in p for p in problems)


def test_flops_per_token_of_the_1b_shape():
    gpu_check = load_gpu_check()
    sizes = gpu_check.SIZES["gpu"]["train"]
    config = gpu_check.qwen2_config(sizes, sizes["seq_len"])
    # 16 layers x (q,o 2 x 2048^2 + k,v 2 x 2048 x 256 + mlp 3 x 2048 x 5632) + LM head 151,936 x 2048
    matmul_params = 16 * (2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 5632) + 151936 * 2048
    expected = 6 * matmul_params + 6 * 16 * 2048 * 2048
    assert gpu_check.flops_per_token(config, sizes["seq_len"]) == expected
