"""Adapter-only weight sync into a real vLLM server (--lora-sync adapters): the engine receives the adapters as a
PEFT folder through its own LoRA loading (`/v1/load_lora_adapter`), not merged weights, and its greedy output
equals that of the same server given the merged weights (W + s B A) instead; a second adapter push replaces the
first in place.

The server is this test's own (started with --enable-lora, which the session's shared server is not: vLLM 0.32's CPU
build with LoRA on fails requests for prompt log-probs; tests/vllm/conftest.py starts it with the session's other
servers), given the tiny fp32 checkpoint's weights first, checked: the post-sync check reads back the layers vLLM's
LoRA layers wrap.
"""

from __future__ import annotations

import pytest
import torch

from stacx.wire.types import GenerateRequest, SamplingParams
from tests.vllm.conftest import LORA_RANK
from tests.vllm.test_vllm_engine import push_checkpoint

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [(3, 4, 5, 6, 7), (8, 9, 10), (11, 3, 5)]


def greedy(engine):
    outputs = engine.generate([GenerateRequest(input_ids=p, sampling=GREEDY) for p in PROMPTS])
    return [list(o.output_ids) for o in outputs], [torch.tensor(o.output_log_probs) for o in outputs]


def push(engine, buckets, version: int) -> None:
    engine.pause()
    try:
        engine.update_weights(buckets, version=version)
        engine.flush_cache()
    finally:
        engine.resume()
    assert engine.weight_version() == version


def trainer_with_adapters(path: str, settings):
    """A megatron policy from `path` with LoRA adapters whose B is far from zero (they change the greedy output)."""
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import attach_lora
    from stacx.serving.cpu_engine import ensure_single_process_layout

    groups = ensure_single_process_layout()
    model = build_model(path, groups, initialize_weights=False)
    load_hf_checkpoint(model, path, groups)
    attach_lora(model, settings, groups)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model, groups


def buckets_of(model, groups, *, adapters: bool) -> list:
    from stacx.models import iter_hf_weight_buckets

    return [[(name, tensor.clone()) for name, tensor in bucket]
            for bucket in iter_hf_weight_buckets(model, groups, 1 << 16, adapters=adapters)]


@pytest.fixture(scope="module")
def lora_server(lora_vllm_start) -> str:
    return lora_vllm_start.wait_until_ready()


def test_an_adapter_push_loads_peft_adapters_and_decodes_as_the_merged_weights(lora_server, vllm_checkpoints):
    from stacx.models.lora import LoraSettings, peft_adapter_config
    from stacx.rollout.engines.vllm import LORA_ADAPTER_NAME, SERVED_MODEL_NAME, VllmEngine

    settings = LoraSettings(rank=LORA_RANK, alpha=16.0, target_modules=("all-linear",))
    model, groups = trainer_with_adapters(vllm_checkpoints[0], settings)
    adapters, merged = buckets_of(model, groups, adapters=True), buckets_of(model, groups, adapters=False)
    assert all(".lora_" in name for bucket in adapters for name, _ in bucket)
    engine = VllmEngine(lora_server)
    try:
        push_checkpoint(engine, vllm_checkpoints[0])  # the weights the adapters were trained on (checked)
        base_ids, base_log_probs = greedy(engine)
        assert engine.model_name() == SERVED_MODEL_NAME

        engine.use_lora_config(peft_adapter_config(settings, base_model=None))
        push(engine, adapters, version=engine.weight_version() + 1)
        assert engine.model_name() == LORA_ADAPTER_NAME
        adapter_ids, adapter_log_probs = greedy(engine)
        assert adapter_ids != base_ids  # the adapters are applied

        with torch.no_grad():  # zero adapters, pushed in place under the same name: the base model's output again
            for name, param in model.named_parameters():
                if name.endswith("lora_b"):
                    param.zero_()
        push(engine, buckets_of(model, groups, adapters=True), version=engine.weight_version() + 1)
        again_ids, again_log_probs = greedy(engine)
        assert again_ids == base_ids
        assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(again_log_probs, base_log_probs))

        # the same server given the first adapters merged into its weights instead decodes what they decoded
        engine.transport.post_json("/v1/unload_lora_adapter", {"lora_name": LORA_ADAPTER_NAME})
        push(engine, merged, version=engine.weight_version() + 1)
        assert engine.model_name() == SERVED_MODEL_NAME
        merged_ids, merged_log_probs = greedy(engine)
        assert merged_ids == adapter_ids
        assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(merged_log_probs, adapter_log_probs))
    finally:
        engine.shutdown()
