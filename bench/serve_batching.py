"""Concurrent callers of the CPU engine: batched (`GenerateBatcher`, what `stacx serve` does) vs one call each.

    python bench/serve_batching.py [--shape S --clients 8 --new-tokens 64 --prompt-len 64 --rounds 3 --threads 2]

`--clients` threads each ask for one prompt at once (greedy, ignore_eos, `--new-tokens` tokens):
  serial   each thread calls `CpuEngine.generate([its request])`: the engine serves one call at a
           time (its lock), so the calls run back to back, as `stacx serve` ran them before batching
  batched  each thread calls `GenerateBatcher.generate([its request])`: the first caller runs alone,
           the others queue behind it and run as one batch (two engine calls in all)
Alternating rounds in one process, same weights (bench/generation.py's Qwen2 shapes); prints the
median wall time of each, the ratio serial / batched, the engine calls made, and whether every
caller got the same tokens both ways. Writes bench/results/serve_batching.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generation import SHAPES, build_pair  # noqa: E402


def run_clients(call, requests) -> tuple[float, list]:
    results = [None] * len(requests)

    def client(index):
        results[index] = call([requests[index]])[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="S", choices=sorted(SHAPES))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "serve_batching.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.request_batching import GenerateBatcher
    from stacx.wire.types import GenerateRequest, SamplingParams

    groups = ensure_single_process_layout()
    model, _ = build_pair(args.shape, args.vocab, args.prompt_len + args.new_tokens, groups)
    engine = CpuEngine(model, seed=0)
    prompts = torch.randint(1, args.vocab, (args.clients, args.prompt_len), generator=torch.Generator().manual_seed(1))
    requests = [GenerateRequest(input_ids=tuple(p), sampling=SamplingParams(
        max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)) for p in prompts.tolist()]
    engine.generate(requests[:2])  # warm-up
    serial_s, batched_s, calls, identical = [], [], [], True
    for _ in range(args.rounds):
        seconds, serial_out = run_clients(engine.generate, requests)
        serial_s.append(seconds)
        batcher = GenerateBatcher(engine)
        seconds, batched_out = run_clients(batcher.generate, requests)
        batched_s.append(seconds)
        calls.append(batcher.num_engine_calls)
        identical &= all(a.output_ids == b.output_ids for a, b in zip(serial_out, batched_out))
    tokens = args.clients * args.new_tokens
    row = {"shape": args.shape, "clients": args.clients, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
           "serial_s": statistics.median(serial_s), "batched_s": statistics.median(batched_s),
           "serial_rounds_s": serial_s, "batched_rounds_s": batched_s, "batched_engine_calls": calls,
           "greedy_tokens_identical": identical, "load_average": os.getloadavg()}
    row["serial_tokens_per_s"] = tokens / row["serial_s"]
    row["batched_tokens_per_s"] = tokens / row["batched_s"]
    row["ratio_batched_over_serial"] = row["serial_s"] / row["batched_s"]
    print(f"{args.shape} {args.clients} clients x {args.new_tokens} tokens: serial {row['serial_tokens_per_s']:.0f} tok/s, "
          f"batched {row['batched_tokens_per_s']:.0f} tok/s ({row['ratio_batched_over_serial']:.2f}x; engine calls "
          f"{calls}); same greedy tokens: {identical}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "serve_batching", "rows": [row], "rounds": args.rounds, "threads": args.threads,
                   "torch": torch.__version__,
                   "rerun": "python bench/serve_batching.py " + " ".join(argv if argv is not None else sys.argv[1:])},
                  f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
