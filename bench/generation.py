"""Generation tokens/s of the CPU engine (KV-cache decoder) against Hugging Face `generate`.

    python bench/generation.py [--shapes S M --new-tokens 128 512 --prompts 16 --prompt-len 64
                                --rounds 3 --threads 2 --include-packed]

For each model shape, one random Qwen2-shaped megatron model is built (seed 0) and its Hugging
Face-named weights are loaded into a `transformers` Qwen2ForCausalLM, so both sides run the same
weights. For each number of new tokens and each mode (greedy; sampled at T = 1 with no top-k /
top-p), in the same process and alternating round by round:
  hf_generate  model.generate(prompts, max_new_tokens=N, min_new_tokens=N), its KV cache, fp32
  stacx        CpuEngine.generate(requests) (decoding="kv_cache"), ignore_eos, per-token log-probs
  packed       (--include-packed) CpuEngine(decoding="packed"), the decoder without a cache
Every run produces prompts x N tokens. Prints the median tokens/s of each and the ratio
stacx / hf_generate (by wall time, and by the process's CPU time, which a shared machine disturbs less), plus the max abs difference between the engine's log-probs and the
trainer's packed forward of the same tokens (fp32). Writes bench/results/generation.json.

Shapes (Qwen2: q/k/v bias, tied embeddings, vocab 32,000):
  S  hidden 128, 4 layers, 4 heads (2 kv), ffn 512       ~5.2M params
  M  hidden 512, 13 layers, 8 heads (2 kv), ffn 1536     ~56M params
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

SHAPES = {
    "S": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=512),
    "M": dict(hidden_size=512, num_hidden_layers=13, num_attention_heads=8, num_key_value_heads=2,
              intermediate_size=1536),
}


def build_pair(shape: str, vocab_size: int, context_length: int, groups):
    """(megatron model, transformers model) of `shape` holding the same random fp32 weights."""
    from transformers import AutoModelForCausalLM

    from stacx.models import build_model, iter_hf_weight_buckets
    from stacx.models.testing import tiny_hf_config

    config = tiny_hf_config("qwen2", vocab_size=vocab_size, max_position_embeddings=context_length,
                            tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                            **SHAPES[shape])
    torch.manual_seed(0)
    model = build_model(config, groups).eval()
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    named = dict(tensor for bucket in iter_hf_weight_buckets(model, groups, bucket_bytes=1 << 62) for tensor in bucket)
    missing, _ = hf_model.load_state_dict(named, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    return model, hf_model


def max_log_prob_error(model, groups, prompts, outputs) -> float:
    """Max |engine log-prob - trainer packed-forward log-prob| over every generated token (T = 1)."""
    from stacx.models import forward_packed, hf_config_of

    vocab_size = hf_config_of(model).vocab_size
    worst = 0.0
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            sequence = list(prompt) + output.output_ids
            logits = forward_packed(model, torch.tensor(sequence), [len(sequence)], groups)[:, :vocab_size]
            ref = torch.log_softmax(logits.double(), -1)[len(prompt) - 1: -1]
            got = torch.tensor(output.output_log_probs, dtype=torch.float64)
            worst = max(worst, (ref.gather(1, torch.tensor(output.output_ids).unsqueeze(1)).squeeze(1) - got).abs().max().item())
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["S"], choices=sorted(SHAPES))
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--include-packed", action="store_true",
                        help="also time the engine's decoder without a cache (slow: one round)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "generation.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.wire.types import GenerateRequest, SamplingParams

    groups = ensure_single_process_layout()
    rows = []
    for shape in args.shapes:
        model, hf_model = build_pair(shape, args.vocab, args.prompt_len + max(args.new_tokens), groups)
        num_params = sum(p.numel() for p in hf_model.parameters())
        engine = CpuEngine(model, seed=0)
        packed = CpuEngine(model, decoding="packed") if args.include_packed else None
        prompts = torch.randint(1, args.vocab, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt_lists = [tuple(p) for p in prompts.tolist()]
        with torch.no_grad():  # warm-up
            hf_model.generate(prompts[:2], attention_mask=torch.ones_like(prompts[:2]), max_new_tokens=4, pad_token_id=0)
        for new_tokens in args.new_tokens:
            for mode in args.modes:
                temperature = 0.0 if mode == "greedy" else 1.0
                requests = [GenerateRequest(input_ids=p, sampling=SamplingParams(
                    max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True, seed=1000 + i))
                    for i, p in enumerate(prompt_lists)]
                num_tokens = args.prompts * new_tokens

                def run_hf():
                    torch.manual_seed(0)
                    with torch.no_grad():
                        out = hf_model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                do_sample=mode == "sampled", temperature=1.0 if mode == "sampled" else None,
                                                top_k=0 if mode == "sampled" else None, top_p=1.0 if mode == "sampled" else None,
                                                pad_token_id=0)
                    assert out.shape == (args.prompts, args.prompt_len + new_tokens), out.shape

                engine.generate(requests[:2])  # warm-up: first weight copy into the cache mirror, allocator
                stacx_times, hf_times, stacx_cpu, hf_cpu, outputs = [], [], [], [], None
                for _ in range(args.rounds):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    outputs = engine.generate(requests)
                    stacx_times.append(time.perf_counter() - start)
                    stacx_cpu.append(time.process_time() - start_cpu)
                    assert sum(len(o.output_ids) for o in outputs) == num_tokens
                    start, start_cpu = time.perf_counter(), time.process_time()
                    run_hf()
                    hf_times.append(time.perf_counter() - start)
                    hf_cpu.append(time.process_time() - start_cpu)
                row = {
                    "shape": shape, "params": num_params, "mode": mode, "prompts": args.prompts,
                    "prompt_len": args.prompt_len, "new_tokens": new_tokens,
                    "stacx_s": statistics.median(stacx_times), "hf_generate_s": statistics.median(hf_times),
                    "stacx_rounds_s": stacx_times, "hf_generate_rounds_s": hf_times,
                    "max_abs_log_prob_error_vs_trainer": max_log_prob_error(model, groups, prompt_lists, outputs),
                }
                row["stacx_tokens_per_s"] = num_tokens / row["stacx_s"]
                row["hf_generate_tokens_per_s"] = num_tokens / row["hf_generate_s"]
                row["ratio_stacx_over_hf"] = row["hf_generate_s"] / row["stacx_s"]
                # CPU seconds (all threads): steadier than wall time when other processes share the cores
                row["stacx_cpu_s"], row["hf_generate_cpu_s"] = statistics.median(stacx_cpu), statistics.median(hf_cpu)
                row["cpu_time_ratio_stacx_over_hf"] = row["hf_generate_cpu_s"] / row["stacx_cpu_s"]
                if packed is not None:
                    start = time.perf_counter()
                    packed_outputs = packed.generate(requests)
                    row["packed_s"] = time.perf_counter() - start
                    row["ratio_packed_over_hf"] = row["hf_generate_s"] / row["packed_s"]
                    if mode == "greedy":
                        row["greedy_identical_to_packed"] = all(
                            a.output_ids == b.output_ids for a, b in zip(outputs, packed_outputs))
                rows.append(row)
                extra = f"  packed {row['packed_s']:.2f} s ({row['ratio_packed_over_hf']:.3f}x)" if packed else ""
                print(f"{shape} ({num_params / 1e6:.1f}M) {mode:7s} {args.prompts}x{new_tokens}: "
                      f"stacx {row['stacx_tokens_per_s']:.0f} tok/s ({row['stacx_s']:.2f} s), "
                      f"hf generate {row['hf_generate_tokens_per_s']:.0f} tok/s ({row['hf_generate_s']:.2f} s), "
                      f"ratio {row['ratio_stacx_over_hf']:.2f}x (cpu-time {row['cpu_time_ratio_stacx_over_hf']:.2f}x), log-prob err {row['max_abs_log_prob_error_vs_trainer']:.1e}"
                      + extra, flush=True)
    result = {
        "benchmark": "generation", "rows": rows, "threads": args.threads, "rounds": args.rounds,
        "torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
        "rerun": "python bench/generation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
