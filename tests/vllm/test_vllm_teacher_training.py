"""Two on-policy distillation steps through `stacx train --algorithm opd --teacher-url URL --teacher-engine vllm`,
the teacher being the session's vLLM server (under torchrun, the student rolling out on its own CPU engine): the
preflight checks the teacher's tokenizer through its `/v1/models` root, every sampled token is scored by vLLM
(prompt log-probs and top-k), and the top-k reverse KL trains. The client and the preflight against a fake
server: tests/rollout/test_teacher_engine_flag.py."""

from __future__ import annotations

import math

import pytest
import requests

from tests.launch.test_custom_code_on_every_rank import run_stacx_train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _prompt_tokens_served(url: str) -> float:
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no vllm:prompt_tokens_total")


def test_two_opd_steps_score_every_sample_with_a_vllm_teacher(vllm_server, vllm_checkpoints, tmp_path):
    url, _ = vllm_server
    before = _prompt_tokens_served(url)
    steps = run_stacx_train("torchrun", [
        "--algorithm", "opd", "--hf-checkpoint", vllm_checkpoints[1], "--prompt-data", "builtin:sorting",
        "--teacher-url", url, "--teacher-engine", "vllm", "--distill-kl-mode", "topk", "--teacher-top-k", "4",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
        "--max-tokens-per-micro-batch", "128", "--lr", "1e-4", "--no-progress-bar", "--no-tensorboard"],
        str(tmp_path / "out"))
    assert len(steps) == 2
    for step in steps:
        assert -math.log(64) < step["rollout/teacher_log_prob_mean"] < 0, step  # vLLM's log-probs of the samples
        assert step["policy/topk_reverse_kl"] > 0 and math.isfinite(step["policy/grad_norm"]), step
    # 2 steps x 2 prompts x 2 samples, each scored with its prompt and response: at least 8 x 7 tokens
    assert _prompt_tokens_served(url) - before >= 2 * 2 * 2 * 7
