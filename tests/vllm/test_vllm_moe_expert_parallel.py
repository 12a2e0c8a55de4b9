"""A tiny Qwen3-MoE served by vLLM (CPU, fp32) and trained at EP=2: one GRPO step under torchrun whose two ranks
each hold half the experts gather them into Hugging Face names, the first rank pushes them into the vLLM server
(`--rollout-urls`), the post-sync check compares every tensor's digest (`--weight-check-every 1`), and vLLM reads
back every tensor it was sent, experts and routers included (vLLM 0.32 keeps Qwen3-MoE's fused experts under
`experts.routed_experts` and its router as a repacked replicated linear on CPU). Its own server: the tier's shared
one serves a dense Llama."""

from __future__ import annotations

import pytest

from tests.launch.test_custom_code_on_every_rank import run_stacx_train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_moe_server(vllm_python, tmp_path_factory):
    from stacx.rollout.engines.vllm import VllmServerProcess
    from stacx.tasks import write_tiny_moe_checkpoint

    # 4 experts, top-2, two heads of 32 (vLLM's CPU attention takes head sizes from 32 up)
    checkpoint = write_tiny_moe_checkpoint(str(tmp_path_factory.mktemp("vllm_moe") / "sorting"), "sorting",
                                           num_experts=4, head_dim=32, seed=0)
    server = VllmServerProcess(checkpoint, python=vllm_python, timeout_s=2400)
    try:
        yield server.url, checkpoint
    finally:
        server.stop()


def test_one_grpo_step_at_ep2_pushes_every_expert_into_vllm_checked(vllm_moe_server, tmp_path):
    from safetensors.torch import load_file

    from stacx.rollout.engines.vllm import VllmEngine

    url, checkpoint = vllm_moe_server
    steps = run_stacx_train("torchrun", [
        "--algorithm", "grpo", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:sorting",
        "--rollout-engine", "vllm", "--rollout-urls", url, "--weight-check-every", "1",
        "--expert-model-parallel-size", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "6", "--max-tokens-per-micro-batch", "128", "--lr", "1e-4",
        "--no-progress-bar", "--no-tensorboard"], str(tmp_path / "out"), num_steps=1)
    assert len(steps) == 1
    engine = VllmEngine(url)
    try:
        assert engine.weight_version() == 1  # the step's weights reached vLLM and passed the digest check
        names = sorted(load_file(f"{checkpoint}/model.safetensors"))
        assert any(".mlp.experts." in name for name in names) and any(name.endswith("mlp.gate.weight") for name in names)
        unreadable = [name for name, digest in engine.weight_digests(names).items() if digest is None]
        assert unreadable == []  # so the run's check compared every tensor, none left unverified
    finally:
        engine.shutdown()
