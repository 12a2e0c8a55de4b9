"""The vLLM engine against a real vLLM server (the session's one, tests/vllm/conftest.py): weights pushed
in Stacx's buckets change what it generates and pass the post-sync check, a corrupted push is caught,
its fp32 log-probs agree with the trainer's forward to 1e-5, and a partial rollout continues across a
weight update with per-token versions."""

from __future__ import annotations

import threading

import pytest
import torch

from stacx.rollout.continuation import continuation_request, join_outputs
from stacx.wire.types import GenerateRequest, SamplingParams
from stacx.rollout.weight_check import DigestingBuckets, WeightSyncMismatch, verify_engine_weights

pytestmark = pytest.mark.vllm

FP32_TOLERANCE = 1e-5
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [(3, 4, 5, 6, 7), (8, 9, 10), (11, 3, 5)]


def checkpoint_buckets(path: str, *, bucket_tensors: int = 5) -> list[list]:
    """A checkpoint's tensors (Hugging Face names) in buckets of a few tensors: q/k/v of one layer fall in
    different buckets, so vLLM's layerwise reload must hold a layer across buckets."""
    from safetensors.torch import load_file

    tensors = sorted(load_file(f"{path}/model.safetensors").items())
    return [tensors[i:i + bucket_tensors] for i in range(0, len(tensors), bucket_tensors)]


def push_checkpoint(engine, path: str, *, check: bool = True) -> int:
    """Push `path`'s weights as the next version, checked after the push; returns the version."""
    version = engine.weight_version() + 1
    digesting = DigestingBuckets(checkpoint_buckets(path), dtype=engine.weight_digest_dtype())
    engine.pause()
    try:
        engine.update_weights(digesting, version=version)
        engine.flush_cache()
    finally:
        engine.resume()
    if check:
        report = verify_engine_weights(engine, digesting.digests, url=engine.url, version=version)
        assert report == {"checked": len(digesting.digests), "unverified": 0}, report
    return version


_TRAINER_MODELS: dict = {}
"""Checkpoint path -> (megatron model, groups): built once per session (a build is seconds of CPU)."""


def trainer_log_probs(path: str, sequences, temperature: float = 1.0):
    """The trainer's fp32 log-probs of `sequences` (megatron model built from `path`, one packed forward)."""
    from stacx.models import build_model, forward_packed, hf_config_of, load_hf_checkpoint
    from stacx.serving.cpu_engine import ensure_single_process_layout

    if path not in _TRAINER_MODELS:
        groups = ensure_single_process_layout()
        model = build_model(path, groups).eval()
        load_hf_checkpoint(model, path, groups)
        _TRAINER_MODELS[path] = model, groups
    model, groups = _TRAINER_MODELS[path]
    lengths = [len(s) for s in sequences]
    with torch.no_grad():
        logits = forward_packed(model, torch.tensor([t for s in sequences for t in s]), lengths, groups)
    logits = logits[:, : hf_config_of(model).vocab_size].double()
    return [torch.log_softmax(x / temperature, -1) for x in torch.split(logits, lengths)]


def greedy(engine):
    return [o.output_ids for o in engine.generate([GenerateRequest(input_ids=p, sampling=GREEDY) for p in PROMPTS])]


def test_weight_push_changes_greedy_output_and_the_digest_check_passes(vllm_engine, vllm_checkpoints):
    served, update = vllm_checkpoints
    push_checkpoint(vllm_engine, served)
    before = greedy(vllm_engine)
    version = push_checkpoint(vllm_engine, update)
    after = greedy(vllm_engine)
    assert after != before
    assert vllm_engine.weight_version() == version
    (ref,) = trainer_log_probs(update, [list(PROMPTS[0]) + after[0]])
    assert after[0] == [int(ref[len(PROMPTS[0]) - 1 + j].argmax()) for j in range(len(after[0]))]
    outputs = vllm_engine.generate([GenerateRequest(input_ids=PROMPTS[0], sampling=GREEDY)])
    assert outputs[0].weight_version == version and outputs[0].output_token_versions == [version] * 8


def test_corrupted_push_is_caught_and_replayed_or_non_finite_buckets_are_refused(vllm_engine, vllm_checkpoints):
    served = vllm_checkpoints[0]
    digesting = DigestingBuckets(checkpoint_buckets(served), dtype=vllm_engine.weight_digest_dtype())
    target = "model.layers.1.self_attn.k_proj.weight"

    def corrupted():  # the bytes change after the trainer's digest: what a broken transport or loader does
        for bucket in digesting:
            yield [(name, tensor + 1e-3 if name == target else tensor) for name, tensor in bucket]

    version = vllm_engine.weight_version() + 1
    vllm_engine.update_weights(corrupted(), version=version)
    with pytest.raises(WeightSyncMismatch, match=target) as caught:
        verify_engine_weights(vllm_engine, digesting.digests, url=vllm_engine.url, version=version)
    assert caught.value.names == [target]
    with pytest.raises(Exception, match="not newer than the version this engine serves"):
        vllm_engine.update_weights(checkpoint_buckets(served)[:1], version=version)
    bad = [[(name, torch.full_like(tensor, float("nan"))) for name, tensor in checkpoint_buckets(served)[0]]]
    with pytest.raises(Exception, match="NaN or infinite"):
        vllm_engine.update_weights(bad, version=version + 1)
    push_checkpoint(vllm_engine, served)  # repaired: the next push loads and checks clean


def test_fp32_log_probs_agree_with_the_trainer(vllm_engine, vllm_checkpoints):
    served = vllm_checkpoints[0]
    push_checkpoint(vllm_engine, served)
    requests = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=12, temperature=t, seed=i,
                                                                     ignore_eos=True))
                for i, (p, t) in enumerate([(PROMPTS[0], 1.0), (PROMPTS[1], 0.7), (PROMPTS[2], 0.0)])]
    outputs = vllm_engine.generate(requests)
    worst = 0.0
    for request, output in zip(requests, outputs):
        temperature = request.sampling.temperature or 1.0
        (ref,) = trainer_log_probs(served, [list(request.input_ids) + output.output_ids], temperature)
        start = len(request.input_ids) - 1
        expected = [ref[start + j, token].item() for j, token in enumerate(output.output_ids)]
        worst = max(worst, max(abs(a - b) for a, b in zip(output.output_log_probs, expected)))
    print(f"vLLM fp32 vs trainer fp32 log-probs: max |diff| {worst:.2e} over {sum(len(o.output_ids) for o in outputs)} tokens")
    assert worst < FP32_TOLERANCE


def test_partial_rollout_continues_across_a_weight_update(vllm_engine, vllm_checkpoints, monkeypatch):
    """The request is frozen mid-answer (vLLM's `/pause?mode=keep`, sent by the stream's reader as soon as the first
    tokens arrive) and aborted while frozen, so its partial answer never depends on how fast the server decodes.
    (Before: the test polled `/metrics` for a running request, and on a quiet machine the 240 tokens were done
    between two polls.)"""
    from stacx.rollout.engines import vllm as vllm_module

    served, update = vllm_checkpoints
    old = push_checkpoint(vllm_engine, served)
    frozen = threading.Event()
    extend = vllm_module.extend_from_chunk

    def extend_then_freeze(output, request, chunk, **kwargs):
        finished = extend(output, request, chunk, **kwargs)
        if request.rid == "partial-1" and output.output_ids and not frozen.is_set():
            vllm_engine.transport.post_json("/pause?mode=keep", {}, summary="pause (keep)")
            frozen.set()
        return finished

    monkeypatch.setattr(vllm_module, "extend_from_chunk", extend_then_freeze)
    request = GenerateRequest(input_ids=PROMPTS[0], rid="partial-1",
                              sampling=SamplingParams(max_new_tokens=240, temperature=1.0, seed=5, ignore_eos=True))
    future = vllm_engine.submit(request)
    try:
        assert frozen.wait(timeout=120), "the request streamed no token"
        vllm_engine.abort(["partial-1"])
        partial = future.result(timeout=60)
    finally:
        vllm_engine.resume()
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 240
    assert partial.output_token_versions == [old] * len(partial.output_ids)
    new = push_checkpoint(vllm_engine, update)
    rest = vllm_engine.generate([continuation_request(request, partial)])[0]
    joined = join_outputs(partial, rest)
    assert len(joined.output_ids) == 240 and joined.finish_reason == "length"
    assert joined.output_token_versions == [old] * len(partial.output_ids) + [new] * len(rest.output_ids)
