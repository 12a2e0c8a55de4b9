"""GPU tier: an adapter-only push (--lora-sync adapters) into a real SGLang server through its LoRA API, and the
server's prompt log-probs then equal the trainer's adapted model's.

The trainer's policy (megatron-core, fp32, this process, on the CPU) carries rank-8 adapters with B far from zero;
the client a run builds (`engine_client("sglang", url)`, told the adapters' PEFT config as the trainer tells it)
pushes only the adapters (`iter_hf_weight_buckets(..., adapters=True)`: `/load_lora_adapter_from_tensors`, then
`/update_weight_version`); a second client, as the driver's, finds the adapter after its version check and names
it in `/generate`. The server is started with the LoRA flags a run's launcher gives (`sglang_lora_args`).

Needs 1 CUDA GPU and SGLang (pip install 'stacx[sglang]'). Run with:
    python -m pytest -m gpu tests/rollout/test_sglang_lora_gpu.py
The protocol on CPU, against a fake server: tests/rollout/test_lora_engine_protocols.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.rollout.test_sglang_tp2_weight_push_gpu import (
    BEFORE_PUSH_MIN_SEPARATION,
    BF16_MAX_ABS_LOG_PROB_ERROR,
    BF16_MEAN_ABS_LOG_PROB_ERROR,
    MODEL,
    PROMPT,
)

LORA_FLAGS = ("--lora-rank", "8", "--lora-alpha", "16.0", "--lora-target-modules", "all-linear")

needs_a_gpu_and_sglang = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
    reason="needs a CUDA GPU and SGLang installed (pip install 'stacx[sglang]'); marked gpu, run with: "
           "pytest -m gpu tests/rollout/test_sglang_lora_gpu.py")


def _trainer_with_adapters(checkpoint: str):
    """The policy with adapters whose B is far from zero, its fp32 prompt log-probs, and its adapter buckets."""
    from stacx.models import build_model, forward_packed, iter_hf_weight_buckets, load_hf_checkpoint
    from stacx.models.lora import LoraSettings, attach_lora
    from stacx.serving.cpu_engine import ensure_single_process_layout

    settings = LoraSettings(rank=8, alpha=16.0)
    groups = ensure_single_process_layout()
    model = build_model(checkpoint, groups, initialize_weights=False)
    load_hf_checkpoint(model, checkpoint, groups)
    attach_lora(model, settings, groups)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        tokens = torch.tensor(PROMPT)
        logits = forward_packed(model.eval(), tokens, [len(PROMPT)], groups)[:, :MODEL["vocab_size"]].double()
        log_probs = torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[1:, None])[:, 0].float()
    buckets = [[(name, tensor.clone()) for name, tensor in bucket]
               for bucket in iter_hf_weight_buckets(model, groups, 1 << 20, adapters=True)]
    return settings, log_probs, buckets


def _server_log_probs(engine) -> torch.Tensor:
    from stacx.wire.types import GenerateRequest, SamplingParams

    request = GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=0), logprob_start_len=0)
    (output,) = engine.generate([request])
    return torch.tensor(output.input_log_probs[1:], dtype=torch.float32)


@pytest.mark.gpu
@needs_a_gpu_and_sglang
def test_an_adapter_push_to_sglang_gives_the_adapted_trainers_log_probs(tmp_path):
    from stacx.models.lora import peft_adapter_config
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.engines.registry import engine_client
    from stacx.rollout.engines.sglang import SglangServerProcess, SglangServerSpec, sglang_lora_args
    from stacx.testing.distributed import find_free_port

    model = dict(MODEL)
    arch = model.pop("arch")
    checkpoint = str(tmp_path / "policy")
    save_tiny_hf_checkpoint(checkpoint, arch, seed=1, **model)
    settings, trainer, buckets = _trainer_with_adapters(checkpoint)
    server = SglangServerProcess(SglangServerSpec(
        model_path=checkpoint, port=find_free_port(), host="127.0.0.1", mem_fraction_static=0.3,
        extra_args=("--skip-tokenizer-init", "--dtype", "bfloat16", "--disable-cuda-graph",
                    *sglang_lora_args(LORA_FLAGS))), startup_timeout_s=600)
    try:
        driver = engine_client("sglang", server.url)
        before = _server_log_probs(driver)
        pusher = engine_client("sglang", server.url)
        pusher.use_lora_config(peft_adapter_config(settings, base_model=None))
        pusher.update_weights(buckets, version=1)
        assert driver.weight_version() == 1
        after = _server_log_probs(driver)
    finally:
        server.stop()

    assert all(".lora_" in name for bucket in buckets for name, _ in bucket)
    separation = (before - trainer).abs().mean().item()  # the base model is far from the adapted one
    assert separation > BEFORE_PUSH_MIN_SEPARATION * BF16_MEAN_ABS_LOG_PROB_ERROR, separation
    error = (after - trainer).abs()
    assert error.max().item() <= BF16_MAX_ABS_LOG_PROB_ERROR, error
    assert error.mean().item() <= BF16_MEAN_ABS_LOG_PROB_ERROR, error
