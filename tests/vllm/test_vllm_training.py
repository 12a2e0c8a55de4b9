"""Two GRPO steps through `stacx train --rollout-engine vllm`, attached to the session's vLLM server with
--rollout-urls, on Ray and under torchrun: the driver generates through vLLM, the policy ranks push their
weights into it (checked after every push: --weight-check-every 1), and the driver confirms the version."""

from __future__ import annotations

import pytest

from stacx.rollout.engines.vllm import VllmEngine
from tests.launch.test_custom_code_on_every_rank import ray_address_for, run_stacx_train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("launcher", ["ray", "torchrun"])
def test_two_grpo_steps_roll_out_on_vllm(launcher, vllm_server, vllm_checkpoints, tmp_path, request):
    url, _ = vllm_server
    engine = VllmEngine(url)
    engine.rpc("stacx_reset_weight_version")  # a new run numbers its pushes from 1
    checkpoint = vllm_checkpoints[0]
    steps = run_stacx_train(launcher, [
        "--algorithm", "grpo", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:sorting",
        "--rollout-engine", "vllm", "--rollout-urls", url, "--weight-check-every", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
        "--max-tokens-per-micro-batch", "64", "--lr", "1e-4", "--no-progress-bar", "--no-tensorboard"],
        str(tmp_path / "out"), ray_address=ray_address_for(launcher, request))
    assert len(steps) == 2
    assert engine.weight_version() == 2  # both steps' weights reached vLLM and passed the digest check
    engine.shutdown()
