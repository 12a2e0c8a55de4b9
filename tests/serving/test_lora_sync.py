"""Adapter-only weight sync into the CPU engine (stacx.models.lora.MergedAdapters), in this process.

A trainer-side model with LoRA adapters (B != 0) streams its adapters only to an engine built with the same
LoRA settings, and its merged weights (W + s B A) to a plain engine: both engines then decode the same greedy
tokens with the same log-probs (the adapters' push changes the output exactly as merging would), the adapter
push is a small fraction of the full one, and a second adapter push replaces the first (W0 is kept: exact unmerge).
"""

from __future__ import annotations

import torch

from stacx.rollout.weight_check import DigestingBuckets, compare_digests
from stacx.wire.types import GenerateRequest, SamplingParams

REQUESTS = [GenerateRequest(input_ids=(4, 10, 11, 12), sampling=SamplingParams(max_new_tokens=8, temperature=0.0)),
            GenerateRequest(input_ids=(7, 3), sampling=SamplingParams(max_new_tokens=6, temperature=0.0))]


def _buckets(model, groups, adapters: bool):
    from stacx.models import iter_hf_weight_buckets

    return [[(name, tensor.clone()) for name, tensor in bucket]
            for bucket in iter_hf_weight_buckets(model, groups, 1 << 16, adapters=adapters)]


def _bytes(buckets) -> int:
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def _greedy(engine):
    outputs = engine.generate(REQUESTS)
    return [(list(o.output_ids), torch.tensor(o.output_log_probs)) for o in outputs]


def test_an_adapter_push_changes_the_engine_output_exactly_as_merging(tmp_path):
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import LoraSettings, attach_lora
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from tests.models.test_lora import _set_adapters

    path = str(tmp_path / "tiny")
    save_tiny_hf_checkpoint(path, "qwen3", seed=0)
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_fc2"))
    adapter_engine = CpuEngine.from_hf_checkpoint(path, lora=settings)
    merged_engine = CpuEngine.from_hf_checkpoint(path)
    base = _greedy(adapter_engine)
    groups = ensure_single_process_layout()
    trainer = build_model(path, groups, initialize_weights=False)
    load_hf_checkpoint(trainer, path, groups)
    attach_lora(trainer, settings, groups)
    _set_adapters(trainer, groups)

    adapters, full = _buckets(trainer, groups, adapters=True), _buckets(trainer, groups, adapters=False)
    assert all(".lora_" in name for bucket in adapters for name, _ in bucket)
    assert _bytes(adapters) < 0.2 * _bytes(full)
    adapter_engine.update_weights(adapters, version=1)
    merged_engine.update_weights(full, version=1)
    # the post-sync check reads the adapters back (what `stacx serve` answers on its digest endpoint): every
    # pushed adapter tensor is there and equal, none unverified
    sent = DigestingBuckets(adapters, dtype=torch.float32)
    list(sent)
    held = adapter_engine.weight_digests(sorted(sent.digests))["digests"]
    assert compare_digests(sent.digests, held, url="in-process", version=1) == []
    by_adapters, by_merging = _greedy(adapter_engine), _greedy(merged_engine)
    assert [ids for ids, _ in by_adapters] == [ids for ids, _ in by_merging]
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for (_, a), (_, b) in zip(by_adapters, by_merging))
    assert [ids for ids, _ in by_adapters] != [ids for ids, _ in base]  # the adapters change the greedy output

    with torch.no_grad():  # zero adapters: the engine is the base model again, bitwise (W0 was kept)
        for name, param in trainer.named_parameters():
            if name.endswith("lora_b"):
                param.zero_()
    adapter_engine.update_weights(_buckets(trainer, groups, adapters=True), version=2)
    again = _greedy(adapter_engine)
    assert [ids for ids, _ in again] == [ids for ids, _ in base]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, base))
