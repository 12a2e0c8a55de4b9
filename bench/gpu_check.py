"""The GPU check: bf16 parity, a ~1B training step (tokens/s, MFU) and the log-prob kernels, one JSON.

    scripts/gpu_check.sh                 # on one CUDA GPU (H200: <= 8 minutes), writes bench/results/gpu.json
    scripts/gpu_check.sh --dry-run       # on CPU: the same code at tiny sizes, then --check of its JSON
    python bench/gpu_check.py [--dry-run] [--out FILE] [--peak-tflops 790] [--sections parity train logprobs]
    python bench/gpu_check.py --check FILE

Sections (each runs in its own try block: one failing section is recorded, the others still run):
  parity    a random Qwen2 checkpoint (qkv bias, tied embeddings) loaded into Stacx's megatron model
            in bf16 and run with `forward_packed` on three packed sequences, against `transformers`'
            fp32 forward of the same checkpoint on the same device (one sequence at a time). Reported:
            max |logit error| / max |reference logit| (pass <= 3e-2, the GPU parity test's bound),
            next to transformers' own bf16 error against its fp32 forward.
  train     one training step of a Qwen2-shaped model (GPU: hidden 2048, 16 layers, 16 heads / 2 KV,
            ffn 5632, vocab 151,936 tied: ~1.0B params) in bf16 with megatron DDP and the fp32-master
            Adam of `stacx.trainer.runtime.optim` (fp32 in the dry run: megatron's bf16 optimizer is CUDA-only): packed micro-batches of whole sequences, forward,
            Stacx's vocab-parallel log-probs, mean NLL, backward, grad sync, optimizer step.
            Tokens/s = tokens per step / median step time; MFU = tokens/s x FLOPs per token / peak,
            FLOPs per token = 6 x (non-embedding params + LM-head params) + 6 x layers x hidden x
            sequence length (causal attention scores and values, forward and backward).
  logprobs  per-token log-probs from hidden [T, H] and the output weight [V, H] (bf16, T = 8192,
            V = 151,936 on GPU), forward + backward to both inputs:
              megatron         logits = hidden @ W^T, megatron-core `vocab_parallel_cross_entropy`
              stacx_unfused    logits = hidden @ W^T, `vocab_parallel_log_probs_and_entropy`
              stacx_fused      `fused_lm_head_log_probs_and_entropy` (logits never built)
            (+ entropy for the Stacx two). Time: median of repeats (CUDA-synchronized); memory: peak
            allocated during the step minus what was allocated before it (CUDA), or the CPU
            profiler's allocation running sum (dry run). Ratios against megatron.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
PARITY_RELATIVE_TOLERANCE = 3e-2
H200_BF16_DENSE_TFLOPS = 790.0
SECTIONS = ("parity", "train", "logprobs")

SIZES = {
    "gpu": {
        "parity": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1536, vocab_size=32000, lengths=[512, 300, 212]),
        "train": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=2,
                      intermediate_size=5632, vocab_size=151936, seq_len=2048, seqs_per_micro_batch=4,
                      micro_batches=2, warmup_steps=2, timed_steps=5, dtype="bf16"),
        "logprobs": dict(tokens=8192, hidden=2048, vocab=151936, repeats=5),
    },
    "dry_run": {
        "parity": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=512, lengths=[24, 16, 8]),
        "train": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=1024, seq_len=32, seqs_per_micro_batch=2,
                      micro_batches=2, warmup_steps=1, timed_steps=2, dtype="fp32"),
        "logprobs": dict(tokens=64, hidden=32, vocab=2048, repeats=2),
    },
}


# ---- setup ------------------------------------------------------------------------------------

def init_single_process(device: torch.device):
    """A one-rank world (NCCL on CUDA, gloo on CPU; in-memory store, no port) and tp = cp = dp = 1."""
    import torch.distributed as dist

    from stacx.parallel.groups import initialize_parallel_layout

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return initialize_parallel_layout(1, 1)


def qwen2_config(sizes: dict, context_length: int):
    from stacx.models.testing import tiny_hf_config

    fields = {k: sizes[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "intermediate_size", "vocab_size")}
    return tiny_hf_config("qwen2", max_position_embeddings=context_length, tie_word_embeddings=True,
                          eos_token_id=None, bos_token_id=None, pad_token_id=0, **fields)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- parity -----------------------------------------------------------------------------------

def run_parity(sizes: dict, device: torch.device, groups) -> dict:
    from transformers import AutoModelForCausalLM

    from stacx.models import build_model, forward_packed, load_hf_checkpoint
    from stacx.models.testing import build_tiny_hf_model

    lengths = sizes["lengths"]
    config = qwen2_config(sizes, max(lengths))
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_hf_model(config, seed=0).save_pretrained(folder, safe_serialization=True)
        model = build_model(folder, groups, params_dtype=torch.bfloat16, initialize_weights=False)
        load_hf_checkpoint(model, folder, groups)
        model = model.to(device).eval()
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        reference_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    tokens = torch.randint(0, config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stacx_logits = forward_packed(model, tokens, lengths, groups)[:, : config.vocab_size].float()
        pieces = tokens.to(device).split(lengths)
        ref = torch.cat([reference(p[None]).logits[0].float() for p in pieces])
        ref_bf16 = torch.cat([reference_bf16(p[None]).logits[0].float() for p in pieces])
    scale = ref.abs().max().item()
    error = (stacx_logits - ref).abs().max().item() / scale
    hf_bf16_error = (ref_bf16 - ref).abs().max().item() / scale
    return {"relative_max_logit_error": error, "transformers_bf16_relative_max_logit_error": hf_bf16_error,
            "tolerance": PARITY_RELATIVE_TOLERANCE, "passed": error <= PARITY_RELATIVE_TOLERANCE,
            "lengths": lengths, "params": sum(p.numel() for p in reference.parameters())}


# ---- training step ----------------------------------------------------------------------------

def flops_per_token(config, seq_len: int) -> float:
    """6 x (non-embedding + LM-head matmul params) + 6 x layers x hidden x seq_len (causal attention)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads, ffn = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    head_dim = hidden // heads
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * ffn
    matmul_params = layers * per_layer + config.vocab_size * hidden  # + the LM head
    return 6.0 * matmul_params + 6.0 * layers * hidden * seq_len


def run_train(sizes: dict, device: torch.device, groups) -> dict:
    from stacx.models import build_model, forward_packed
    from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy
    from stacx.trainer.config.run import OptimSection
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    seq_len, per_micro, num_micro = sizes["seq_len"], sizes["seqs_per_micro_batch"], sizes["micro_batches"]
    config = qwen2_config(sizes, seq_len)
    torch.manual_seed(0)
    # The dry run trains in fp32: megatron's bf16 optimizer (fp32 master weights) accepts CUDA tensors only.
    params_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[sizes["dtype"]]
    model = build_model(config, groups, params_dtype=params_dtype).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, OptimSection(lr=1e-5, clip_grad=1.0), total_steps=100)
    generator = torch.Generator().manual_seed(3)
    micro_batches = [torch.randint(0, config.vocab_size, (per_micro * seq_len,), generator=generator)
                     for _ in range(num_micro)]
    lengths = [seq_len] * per_micro
    tokens_per_step = num_micro * per_micro * seq_len

    def step() -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        total = 0.0
        for tokens in micro_batches:
            logits = forward_packed(ddp, tokens, lengths, groups)  # [T, V] fp32
            targets = tokens.to(logits.device).roll(-1)  # the last token of each sequence predicts garbage: fine
            log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, targets, with_entropy=False)
            loss = -log_probs.mean() / num_micro
            loss.backward()
            total += float(loss.detach())
        ddp.finish_grad_sync()
        updated, _, _ = optimizer.step()
        scheduler.step(increment=1)
        assert updated, "the optimizer skipped the step (non-finite gradients)"
        return total

    losses = [step() for _ in range(sizes["warmup_steps"])]
    times = []
    for _ in range(sizes["timed_steps"]):
        synchronize(device)
        start = time.perf_counter()
        losses.append(step())
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens_per_s = tokens_per_step / seconds
    flops = flops_per_token(config, seq_len)
    result = {"params": num_params, "dtype": sizes["dtype"], "tokens_per_step": tokens_per_step, "seq_len": seq_len,
              "step_seconds": seconds, "step_rounds_s": times, "tokens_per_s": tokens_per_s,
              "flops_per_token": flops, "achieved_tflops": tokens_per_s * flops / 1e12, "losses": losses}
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


# ---- log-prob kernels -------------------------------------------------------------------------

def megatron_step(hidden, weight, targets, with_entropy):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    assert not with_entropy
    logits = hidden @ weight.t()
    vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).sum().backward()


def stacx_unfused_step(hidden, weight, targets, with_entropy):
    from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy

    log_probs, entropy = vocab_parallel_log_probs_and_entropy(hidden @ weight.t(), targets, with_entropy=with_entropy)
    (-log_probs.sum() - (0.01 * entropy.sum() if with_entropy else 0.0)).backward()


def stacx_fused_step(hidden, weight, targets, with_entropy):
    from stacx.parallel.fused_lm_head_logprobs import fused_lm_head_log_probs_and_entropy

    log_probs, entropy = fused_lm_head_log_probs_and_entropy(hidden, weight, targets, with_entropy=with_entropy)
    (-log_probs.sum() - (0.01 * entropy.sum() if with_entropy else 0.0)).backward()


LOGPROB_METHODS = {
    "megatron": (megatron_step, False),
    "stacx_unfused": (stacx_unfused_step, False),
    "stacx_fused": (stacx_fused_step, False),
    "stacx_unfused_entropy": (stacx_unfused_step, True),
    "stacx_fused_entropy": (stacx_fused_step, True),
}


def peak_extra_bytes(step, hidden, weight, targets, with_entropy) -> int:
    if hidden.device.type == "cuda":
        synchronize(hidden.device)
        torch.cuda.reset_peak_memory_stats(hidden.device)
        before = torch.cuda.memory_allocated(hidden.device)
        step(hidden, weight, targets, with_entropy)
        synchronize(hidden.device)
        peak = torch.cuda.max_memory_allocated(hidden.device) - before
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(hidden, weight, targets, with_entropy)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        running = peak = 0
        for _, nbytes in events:
            running += nbytes
            peak = max(peak, running)
    hidden.grad = weight.grad = None
    return peak


def run_logprobs(sizes: dict, device: torch.device, groups) -> dict:
    num_tokens, hidden_size, vocab = sizes["tokens"], sizes["hidden"], sizes["vocab"]
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(device, torch.bfloat16)
    weight.requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator).to(device)
    for step, with_entropy in LOGPROB_METHODS.values():  # warm-up (kernels, allocator)
        step(hidden, weight, targets, with_entropy)
        hidden.grad = weight.grad = None
    times = {name: [] for name in LOGPROB_METHODS}
    for _ in range(sizes["repeats"]):  # round-robin: drift hits every method alike
        for name, (step, with_entropy) in LOGPROB_METHODS.items():
            synchronize(device)
            start = time.perf_counter()
            step(hidden, weight, targets, with_entropy)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
            hidden.grad = weight.grad = None
    logits_bytes = num_tokens * vocab * 2  # the bf16 logits the unfused paths build
    runs = {}
    for name, (step, with_entropy) in LOGPROB_METHODS.items():
        runs[name] = {"seconds": statistics.median(times[name]),
                      "peak_extra_bytes": peak_extra_bytes(step, hidden, weight, targets, with_entropy)}
        runs[name]["peak_ratio_vs_logits"] = runs[name]["peak_extra_bytes"] / logits_bytes
    base = runs["megatron"]
    for run in runs.values():
        run["time_ratio_vs_megatron"] = run["seconds"] / base["seconds"]
        run["peak_ratio_vs_megatron"] = run["peak_extra_bytes"] / base["peak_extra_bytes"]
    return {"tokens": num_tokens, "hidden": hidden_size, "vocab": vocab, "dtype": "bf16",
            "logits_bytes": logits_bytes, "repeats": sizes["repeats"], "runs": runs}


# ---- driver -----------------------------------------------------------------------------------

RUNNERS = {"parity": run_parity, "train": run_train, "logprobs": run_logprobs}


def check_result(result: dict) -> list[str]:
    """Problems with a gpu.json (empty: it is complete and consistent)."""
    problems = []
    for key in ("mode", "device", "sections", "peak_tflops", "torch"):
        if key not in result:
            problems.append(f"missing key {key!r}")
    sections = result.get("sections", {})
    for name in SECTIONS:
        section = sections.get(name)
        if section is None:
            problems.append(f"section {name!r} is missing")
        elif "error" in section:
            problems.append(f"section {name!r} failed: {section['error'].splitlines()[-1]}")
    parity = sections.get("parity", {})
    if "passed" in parity and not parity["passed"]:
        problems.append(f"parity: relative logit error {parity['relative_max_logit_error']:.3g} > {parity['tolerance']}")
    train = sections.get("train", {})
    if "tokens_per_s" in train:
        if not train["tokens_per_s"] > 0 or not 0 < train.get("mfu", 0) < 1:
            problems.append(f"train: implausible tokens/s {train['tokens_per_s']} or MFU {train.get('mfu')}")
        if not all(map(lambda x: x == x and abs(x) < float("inf"), train["losses"])):
            problems.append("train: a loss is not finite")
    runs = sections.get("logprobs", {}).get("runs", {})
    if runs and set(runs) != set(LOGPROB_METHODS):
        problems.append(f"logprobs: methods {sorted(runs)} != {sorted(LOGPROB_METHODS)}")
    for name, run in runs.items():
        if not (run["seconds"] > 0 and run["peak_extra_bytes"] > 0):
            problems.append(f"logprobs {name}: non-positive time or memory")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks this script's logic")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                        help="the chip's dense bf16 peak, for MFU (H200: 790)")
    parser.add_argument("--check", metavar="FILE", help="only check a written gpu.json; exit 1 on problems")
    args = parser.parse_args(argv)
    if args.check:
        problems = check_result(json.loads(Path(args.check).read_text()))
        for problem in problems:
            print(f"gpu_check: {problem}", file=sys.stderr)
        print(f"gpu_check: {args.check}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run to check the logic on CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    sizes = SIZES["dry_run" if args.dry_run else "gpu"]
    torch.backends.cuda.matmul.allow_tf32 = True
    groups = init_single_process(device)
    result = {
        "benchmark": "gpu_check", "mode": "dry_run" if args.dry_run else "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "peak_tflops": args.peak_tflops, "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0], "sections": {},
    }
    started = time.perf_counter()
    for name in args.sections:
        section_start = time.perf_counter()
        try:
            section = RUNNERS[name](sizes[name], device, groups)
        except Exception:  # noqa: BLE001 - record it and run the other sections (one GPU session, one try)
            section = {"error": traceback.format_exc()}
        section["seconds_total"] = time.perf_counter() - section_start
        if name == "train" and "tokens_per_s" in section:
            section["mfu"] = section["achieved_tflops"] / args.peak_tflops
        result["sections"][name] = section
        print(f"[{name}] " + json.dumps({k: v for k, v in section.items() if k not in ("runs", "losses", "error")}),
              flush=True)
        if "error" in section:
            print(section["error"], file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["seconds_total"] = time.perf_counter() - started
    for name, run in result["sections"].get("logprobs", {}).get("runs", {}).items():
        print(f"  {name:22s} {run['seconds'] * 1e3:8.2f} ms ({run['time_ratio_vs_megatron']:.2f}x megatron)  "
              f"peak extra {run['peak_extra_bytes'] / 2**20:9.1f} MiB ({run['peak_ratio_vs_megatron']:.2f}x megatron, "
              f"{run['peak_ratio_vs_logits']:.2f}x the logits)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} in {result['seconds_total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
