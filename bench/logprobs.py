"""Peak extra memory and time of per-token log-probs (+ entropy), forward and backward.

    python bench/logprobs.py [--tokens 512] [--vocab 151936] [--dtype bf16] [--repeats 3]
                             [--lm-head-tokens 512] [--hidden 256] [--lm-head-dtype fp32] [--device cpu]

Section "logits": compared in the same process, on the same logits shard [tokens, vocab] (TP = 1):
- stacx:    vocab_parallel_log_probs_and_entropy (chunked; softmax recomputed in backward)
- gather:   the naive path: (all-gather the shard, a no-op at TP=1) fp32 log_softmax, take the
            targets, entropy from the same log_softmax, autograd keeps it all
- megatron: megatron-core's vocab_parallel_cross_entropy (log-probs = -loss; it has no entropy)

Memory method: torch.profiler with profile_memory=True records every CPU allocator allocation
and free ("[memory]" events with signed byte counts). Their running sum, in time order, over a
forward+backward that starts with only the logits alive, peaks at the extra memory the method
needed (including the logits' gradient). Reported as a ratio to the logits shard's bytes.
Time: median wall time of `repeats` forward+backward runs without the profiler.

Section "lm-head": from hidden states [lm-head-tokens, hidden] and the output weight [vocab, hidden]
(TP = 1), forward+backward to d/dhidden and d/dweight:
- fused:    fused_lm_head_log_probs_and_entropy (chunks of tokens; logits recomputed in backward)
- unfused:  logits = hidden @ weight.T, then vocab_parallel_log_probs_and_entropy (the path it replaces)
Memory: on CPU the profiler's running sum as above, starting with hidden and weight alive; on CUDA
torch.cuda.max_memory_allocated() minus the memory allocated before the step. "working" memory is
that peak minus the bytes of the two gradients both paths must return (d/dhidden, d/dweight in the
inputs' dtype), reported as a ratio to the logits shard [tokens, vocab] the fused path never builds.
Results: printed as ratios and written to bench/results/logprobs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from stacx.parallel.fused_lm_head_logprobs import default_tile, fused_lm_head_log_probs_and_entropy
from stacx.parallel.vocab_parallel import default_chunk_tokens, vocab_parallel_log_probs_and_entropy

ENTROPY_COEF = 0.01
RESULTS = Path(__file__).resolve().parent / "results" / "logprobs.json"


def stacx_step(logits, targets, with_entropy):
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, with_entropy=with_entropy)
    loss = -log_probs.sum() - (ENTROPY_COEF * entropy.sum() if with_entropy else 0.0)
    loss.backward()


def gather_step(logits, targets, with_entropy):
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    log_probs = log_softmax.gather(1, targets[:, None])[:, 0]
    loss = -log_probs.sum()
    if with_entropy:
        loss = loss - ENTROPY_COEF * (-(log_softmax.exp() * log_softmax).sum(-1)).sum()
    loss.backward()


def megatron_step(logits, targets, with_entropy):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    assert not with_entropy, "megatron-core's vocab_parallel_cross_entropy computes no entropy"
    # It works in place on fp32 input: hand it its own copy so the shard survives (not counted).
    loss = vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1))
    loss.sum().backward()


def measure_peak_extra_bytes(step, logits, targets, with_entropy) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(logits, targets, with_entropy)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    logits.grad = None
    return peak


def measure_seconds(step, make_logits, targets, with_entropy, repeats) -> float:
    times = []
    for _ in range(repeats):
        logits = make_logits()
        start = time.perf_counter()
        step(logits, targets, with_entropy)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def init_single_rank_megatron() -> None:
    from stacx.parallel.groups import initialize_parallel_layout
    from stacx.testing.distributed import find_free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    initialize_parallel_layout(1, 1)


def fused_lm_head_step(hidden, weight, targets, with_entropy):
    log_probs, entropy = fused_lm_head_log_probs_and_entropy(hidden, weight, targets, with_entropy=with_entropy)
    loss = -log_probs.sum() - (ENTROPY_COEF * entropy.sum() if with_entropy else 0.0)
    loss.backward()


def unfused_lm_head_step(hidden, weight, targets, with_entropy):
    logits = hidden @ weight.t()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, with_entropy=with_entropy)
    loss = -log_probs.sum() - (ENTROPY_COEF * entropy.sum() if with_entropy else 0.0)
    loss.backward()


def lm_head_peak_extra_bytes(step, hidden, weight, targets, with_entropy) -> int:
    """Peak bytes allocated during one forward+backward beyond what was alive before it."""
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(hidden, weight, targets, with_entropy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(hidden, weight, targets, with_entropy)
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        running = peak = 0
        for _, nbytes in events:
            running += nbytes
            peak = max(peak, running)
    hidden.grad = weight.grad = None
    return peak


def lm_head_seconds(step, hidden, weight, targets, with_entropy, repeats) -> float:
    times = []
    for _ in range(repeats):
        if hidden.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(hidden, weight, targets, with_entropy)
        if hidden.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        hidden.grad = weight.grad = None
    return statistics.median(times)


def run_lm_head_section(args) -> dict:
    """Fused vs unfused LM-head log-probs (+ entropy) on one [tokens, hidden] x [vocab, hidden] problem."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.lm_head_dtype]
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(1)
    num_tokens, vocab, hidden_size = args.lm_head_tokens, args.vocab, args.hidden
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen).to(device)
    element = hidden.element_size()
    shard_bytes = num_tokens * vocab * element  # the logits shard the fused path never materializes
    gradient_bytes = (hidden.numel() + weight.numel()) * element
    methods = {
        "fused_log_probs_entropy": (fused_lm_head_step, True),
        "unfused_log_probs_entropy": (unfused_lm_head_step, True),
        "fused_log_probs": (fused_lm_head_step, False),
        "unfused_log_probs": (unfused_lm_head_step, False),
    }
    # Round-robin repeats: on a shared machine, load drift then hits every method alike.
    times = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, (step, with_entropy) in methods.items():
            times[name].append(lm_head_seconds(step, hidden, weight, targets, with_entropy, 1))
    runs = {}
    for name, (step, with_entropy) in methods.items():
        peak = lm_head_peak_extra_bytes(step, hidden, weight, targets, with_entropy)
        seconds = statistics.median(times[name])
        working = peak - gradient_bytes
        runs[name] = {"seconds": seconds, "peak_extra_bytes": peak, "working_bytes": working,
                      "working_ratio_vs_logits_shard": working / shard_bytes}
        print(f"{name:28s} {seconds * 1e3:9.1f} ms   peak extra {peak / 2**20:8.1f} MiB, "
              f"working {working / 2**20:8.1f} MiB = {working / shard_bytes:5.2f} x logits shard")
    summary = {
        "sizes": {"tokens": num_tokens, "hidden": hidden_size, "vocab": vocab, "tensor_model_parallel_size": 1,
                  "dtype": args.lm_head_dtype, "device": str(device),
                  "tile": list(default_tile(num_tokens, vocab)), "logits_shard_bytes": shard_bytes,
                  "input_gradient_bytes": gradient_bytes, "repeats": args.repeats},
        "time_ratio_fused_vs_unfused": runs["fused_log_probs"]["seconds"] / runs["unfused_log_probs"]["seconds"],
        "time_ratio_fused_vs_unfused_with_entropy":
            runs["fused_log_probs_entropy"]["seconds"] / runs["unfused_log_probs_entropy"]["seconds"],
        "working_memory_ratio_vs_logits_shard": runs["fused_log_probs_entropy"]["working_ratio_vs_logits_shard"],
        "peak_memory_ratio_fused_vs_unfused":
            runs["fused_log_probs_entropy"]["peak_extra_bytes"] / runs["unfused_log_probs_entropy"]["peak_extra_bytes"],
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["all", "logits", "lm-head"], default="all")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1 keeps timings stable on a shared CPU)")
    parser.add_argument("--lm-head-tokens", type=int, default=512,
                        help="tokens of the lm-head section (GPU target: 4096)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the lm-head section")
    parser.add_argument("--lm-head-dtype", choices=["bf16", "fp32"], default="fp32",
                        help="fp32 on CPU (bf16 matmuls are several times slower there); bf16 on GPU")
    parser.add_argument("--device", default="cpu", help="device of the lm-head section: cpu or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    summary = {}
    if args.section in ("all", "logits"):
        summary = run_logits_section(args)
    if args.section in ("all", "lm-head"):
        summary["fused_lm_head"] = run_lm_head_section(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def run_logits_section(args) -> dict:
    """Stacx vs the naive path vs megatron-core on one logits shard (the original benchmark)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    init_single_rank_megatron()

    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(args.tokens, args.vocab, generator=gen) * 2).to(dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    shard_bytes = base.numel() * base.element_size()

    def make_logits():
        return base.clone().requires_grad_()

    runs = {
        "stacx_log_probs_entropy": (stacx_step, True),
        "gather_log_probs_entropy": (gather_step, True),
        "stacx_log_probs": (stacx_step, False),
        "gather_log_probs": (gather_step, False),
        "megatron_log_probs": (megatron_step, False),
    }
    results = {}
    for name, (step, with_entropy) in runs.items():
        peak = measure_peak_extra_bytes(step, make_logits(), targets, with_entropy)
        seconds = measure_seconds(step, make_logits, targets, with_entropy, args.repeats)
        results[name] = {"seconds": seconds, "peak_extra_bytes": peak, "peak_extra_ratio_vs_shard": peak / shard_bytes}
        print(f"{name:28s} {seconds * 1e3:9.1f} ms   peak extra {peak / 2**20:8.1f} MiB = {peak / shard_bytes:5.2f} x shard")

    ours, ours_lp = results["stacx_log_probs_entropy"], results["stacx_log_probs"]
    summary = {
        "sizes": {"tokens": args.tokens, "vocab": args.vocab, "tensor_model_parallel_size": 1, "dtype": args.dtype,
                  "chunk_tokens": default_chunk_tokens(args.tokens, args.vocab), "shard_bytes": shard_bytes,
                  "repeats": args.repeats, "torch_threads": torch.get_num_threads()},
        "peak_memory_ratio_vs_shard": ours["peak_extra_ratio_vs_shard"],
        "time_ratio_vs_megatron": ours_lp["seconds"] / results["megatron_log_probs"]["seconds"],
        "time_ratio_vs_megatron_with_entropy": ours["seconds"] / results["megatron_log_probs"]["seconds"],
        "time_ratio_vs_gather": ours["seconds"] / results["gather_log_probs_entropy"]["seconds"],
        "peak_memory_ratio_vs_megatron": ours_lp["peak_extra_bytes"] / results["megatron_log_probs"]["peak_extra_bytes"],
        "peak_memory_ratio_vs_gather": ours["peak_extra_bytes"] / results["gather_log_probs_entropy"]["peak_extra_bytes"],
        "runs": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    sys.exit(main())
