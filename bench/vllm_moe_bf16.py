"""vLLM serving a tiny Qwen3-MoE in bf16: generation, a checked weight push, and the trainer-vs-vLLM log-prob
mismatch in bf16 with the off-policy corrections (TIS/MIS) applied to it.

    python bench/vllm_moe_bf16.py --vllm-python ENV/bin/python [--samples 16 --new-tokens 24] [--dense]

Writes two random tiny Qwen3-MoE checkpoints (4 experts, top-2, hidden 64, two heads of 32: vLLM's CPU attention
takes head sizes from 32 up; `--dense`: the tier's Llama shape instead) and casts them to bf16, starts one vLLM
server on the first (the checkpoint's dtype: bf16), generates greedily, pushes the second's weights in Stacx's
buckets with the post-sync check (digest per tensor, read back from vLLM's fused expert weights), generates again,
then samples at temperature 1 and scores the samples with the trainer's megatron model of the same bf16 weights,
in bf16 and in fp32. Prints the mismatch (|delta|, k3, as `mismatch_metrics` reports them) and what `token_tis`,
`token_mis`, `sequence_tis` and `sequence_mis` do to it at their default thresholds; writes
bench/results/vllm_moe_bf16.json (docs/vllm.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_moe_bf16.json")
PROMPTS = [(3, 4, 5, 6, 7), (8, 9, 10), (11, 3, 5), (6, 6, 2, 9)]


def write_bf16_checkpoint(folder: str, *, seed: int, dense: bool) -> str:
    """A tiny random checkpoint (MoE, or the tier's dense Llama) with its tensors and config in bf16."""
    from safetensors.torch import load_file, save_file

    from stacx.tasks import write_tiny_checkpoint, write_tiny_moe_checkpoint

    if dense:
        write_tiny_checkpoint(folder, "sorting", seed=seed, num_attention_heads=2, max_position_embeddings=256)
    else:
        write_tiny_moe_checkpoint(folder, "sorting", num_experts=4, head_dim=32, seed=seed)
    weights = os.path.join(folder, "model.safetensors")
    save_file({name: tensor.to(torch.bfloat16).contiguous() for name, tensor in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    return folder


def checkpoint_buckets(path: str, bucket_tensors: int = 5) -> list[list]:
    from safetensors.torch import load_file

    tensors = sorted(load_file(os.path.join(path, "model.safetensors")).items())
    return [tensors[i:i + bucket_tensors] for i in range(0, len(tensors), bucket_tensors)]


def trainer_log_probs(path: str, sequences, dtype: torch.dtype) -> list[torch.Tensor]:
    """The trainer's log-probs [len, vocab] of each sequence: megatron model of `path` in `dtype`, one packed forward."""
    from stacx.models import build_model, forward_packed, hf_config_of, load_hf_checkpoint
    from stacx.serving.cpu_engine import ensure_single_process_layout

    groups = ensure_single_process_layout()
    model = build_model(path, groups, params_dtype=dtype).eval()
    load_hf_checkpoint(model, path, groups)
    lengths = [len(s) for s in sequences]
    with torch.no_grad():
        logits = forward_packed(model, torch.tensor([t for s in sequences for t in s]), lengths, groups)
    logits = logits[:, : hf_config_of(model).vocab_size].float()
    return [torch.log_softmax(x, -1) for x in torch.split(logits, lengths)]


def corrections(train: list[torch.Tensor], rollout: list[torch.Tensor]) -> dict:
    """Mismatch metrics per token and what each TIS/MIS correction does at its default thresholds."""
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.objectives.off_policy import sequence_mis, sequence_tis, token_mis, token_tis

    masks = [torch.ones_like(t) for t in train]
    tokens = sum(len(t) for t in train)
    delta = torch.cat(train).double() - torch.cat(rollout).double()
    row = {"tokens": tokens, "max_abs_delta": delta.abs().max().item(), "mean_abs_delta": delta.abs().mean().item()}
    config = AlgorithmConfig()
    for name, correction in (("token_tis", token_tis), ("sequence_tis", sequence_tis), ("token_mis", token_mis),
                             ("sequence_mis", sequence_mis)):
        result = correction(config, train, rollout, masks)
        metrics = {key: value.item() / tokens for key, value in result.metrics.items()}
        row.setdefault("mismatch_k1", metrics["mismatch_k1"])
        row.setdefault("mismatch_k3", metrics["mismatch_k3"])
        kept = torch.cat(result.loss_masks)
        weights = torch.cat(result.weights)
        row[name] = {"affected_fraction": metrics.get(f"{name}_clipped", metrics.get(f"{name}_masked")),
                     "kept_fraction": kept.mean().item(),
                     "weight_min": weights[kept > 0].min().item(), "weight_max": weights[kept > 0].max().item()}
    return row


def main() -> None:
    from stacx.rollout.engines.vllm import VllmEngine, VllmServerProcess, vllm_python
    from stacx.rollout.weight_check import DigestingBuckets, verify_engine_weights
    from stacx.wire.types import GenerateRequest, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None, help="the vLLM environment's python (or STACX_VLLM_PYTHON)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--dense", action="store_true", help="the tier's dense Llama shape instead of the MoE")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    python = vllm_python(args.vllm_python)
    root = tempfile.mkdtemp(prefix="vllm-moe-bf16-")
    served, update = (write_bf16_checkpoint(os.path.join(root, f"seed{seed}"), seed=seed, dense=args.dense)
                      for seed in (0, 1))
    started = time.perf_counter()
    server = VllmServerProcess(served, python=python, timeout_s=2400)
    result = {"model": "llama dense" if args.dense else "qwen3_moe 4 experts top-2", "dtype": "bfloat16",
              "server_start_s": time.perf_counter() - started, "load_average": os.getloadavg()[0],
              "cpus": os.cpu_count(), "machine": platform.machine()}
    engine = VllmEngine(server.url)
    try:
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        before = [o.output_ids for o in engine.generate([GenerateRequest(input_ids=p, sampling=greedy) for p in PROMPTS])]
        digesting = DigestingBuckets(checkpoint_buckets(update), dtype=engine.weight_digest_dtype())
        started = time.perf_counter()
        engine.pause()
        try:
            engine.update_weights(digesting, version=1)
            engine.flush_cache()
        finally:
            engine.resume()
        result["push_s"] = time.perf_counter() - started
        started = time.perf_counter()
        result["check"] = verify_engine_weights(engine, digesting.digests, url=engine.url, version=1)
        result["check_s"] = time.perf_counter() - started
        after = [o.output_ids for o in engine.generate([GenerateRequest(input_ids=p, sampling=greedy) for p in PROMPTS])]
        result["greedy_changed_by_push"] = sum(a != b for a, b in zip(after, before))
        (reference,) = trainer_log_probs(update, [list(PROMPTS[0]) + after[0]], torch.float32)
        start = len(PROMPTS[0]) - 1
        result["greedy_equals_trainer_argmax"] = after[0] == [int(reference[start + j].argmax())
                                                              for j in range(len(after[0]))]
        requests = [GenerateRequest(input_ids=PROMPTS[i % len(PROMPTS)],
                                    sampling=SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i,
                                                            ignore_eos=True))
                    for i in range(args.samples)]
        outputs = engine.generate(requests)
    finally:
        engine.shutdown()
        server.stop()
    sequences = [list(r.input_ids) + o.output_ids for r, o in zip(requests, outputs)]
    rollout = [torch.tensor(o.output_log_probs, dtype=torch.float64) for o in outputs]
    for label, dtype in (("trainer_bf16", torch.bfloat16), ("trainer_fp32", torch.float32)):
        scored = trainer_log_probs(update, sequences, dtype)
        train = [s[len(r.input_ids) - 1 + torch.arange(len(o.output_ids)), torch.tensor(o.output_ids)].double()
                 for s, r, o in zip(scored, requests, outputs)]
        result[label] = corrections(train, rollout)
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
