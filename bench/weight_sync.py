"""Weight-sync bandwidth of the CPU engine's update path against a plain in-memory copy.

    python bench/weight_sync.py [--hidden 768 --layers 6 --vocab 32000 --bucket-mb 64 --repeats 3]

Builds a llama-shaped model of a few hundred MB, takes its Hugging Face-named weights as
buckets (prepared before timing), and measures, in the same process:
  baseline   dst.copy_(src) of the same tensors into preallocated buffers (one memcpy each)
  in_process CpuEngine.update_weights(buckets)      (receiver: map names, fuse q/k/v and gate/up, copy)
  serve_shm  HttpEngine -> stacx serve on 127.0.0.1, bucket staged in shared memory (copy in, copy out)
  serve_http HttpEngine -> stacx serve, bucket bytes in the request body over loopback TCP
Prints GB/s and each path's ratio to the baseline; writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "weight_sync.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from stacx.models import build_model, iter_hf_weight_buckets
    from stacx.models.testing import tiny_hf_config
    from stacx.rollout.engines.http import HttpEngine
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer
    from stacx.wire.http_client import RetryPolicy

    groups = ensure_single_process_layout()
    config = tiny_hf_config("llama", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=4 * args.hidden, num_attention_heads=args.hidden // 64,
                            num_key_value_heads=args.hidden // 64, tie_word_embeddings=False)
    engine = CpuEngine(build_model(config, groups))
    bucket_bytes = args.bucket_mb << 20
    buckets = [[(n, t.clone()) for n, t in b] for b in iter_hf_weight_buckets(engine.model, groups, bucket_bytes)]
    tensors = [t for b in buckets for _, t in b]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    destinations = [torch.empty_like(t) for t in tensors]

    def baseline():
        for dst, src in zip(destinations, tensors):
            dst.copy_(src)

    version = iter(range(1, 10**6))
    results = {"baseline": best_seconds(baseline, args.repeats),
               "in_process": best_seconds(lambda: engine.update_weights(buckets, version=next(version)), args.repeats)}
    with EngineHttpServer(engine) as server:
        for transport in ("shm", "http"):
            client = HttpEngine(server.url, RetryPolicy(timeout_s=600, max_attempts=1), weight_transport=transport,
                                api_key=server.api_key)
            results[f"serve_{transport}"] = best_seconds(
                lambda: client.update_weights(buckets, version=next(version)), args.repeats)
            assert client.weight_version() == engine.weight_version()
            client.shutdown()

    report = {
        "model_bytes": num_bytes, "num_tensors": len(tensors), "num_buckets": len(buckets), "bucket_mb": args.bucket_mb,
        "threads": args.threads, "repeats": args.repeats, "python": sys.version.split()[0], "torch": torch.__version__,
        "machine": platform.machine(), "paths": {},
    }
    base_gbps = num_bytes / results["baseline"] / 1e9
    print(f"weights: {num_bytes / 1e6:.0f} MB in {len(tensors)} tensors, {len(buckets)} buckets of <= {args.bucket_mb} MB")
    for name, seconds in results.items():
        gbps = num_bytes / seconds / 1e9
        report["paths"][name] = {"seconds": seconds, "GB_per_s": gbps, "ratio_to_copy": gbps / base_gbps}
        print(f"{name:>10}: {seconds * 1e3:8.1f} ms  {gbps:6.2f} GB/s  ratio to copy {gbps / base_gbps:5.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
