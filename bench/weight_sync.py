"""Weight-sync bandwidth of the CPU engine's update path against a plain in-memory copy (and vLLM's).

    python bench/weight_sync.py [--hidden 768 --layers 6 --vocab 32000 --bucket-mb 64 --repeats 3]
                                [--vllm-python ENV/bin/python]

Builds a llama-shaped model of a few hundred MB, takes its Hugging Face-named weights as
buckets (prepared before timing), and measures, in the same process:
  baseline   dst.copy_(src) of the same tensors into preallocated buffers (one memcpy each)
  in_process CpuEngine.update_weights(buckets)      (receiver: map names, fuse q/k/v and gate/up, copy)
  serve_shm  HttpEngine -> stacx serve on 127.0.0.1, bucket staged in shared memory (copy in, copy out)
  serve_http HttpEngine -> stacx serve, bucket bytes in the request body over loopback TCP
  vllm_shm   VllmEngine -> a vLLM server (--vllm-python: its environment) serving the same weights, each
             bucket staged in shared memory and loaded by Stacx's worker extension (layerwise reload)
and the post-sync check (stacx.rollout.weight_check: the sender's digests while streaming, the engine's
read-back digests, the comparison) after a push to `stacx serve` and to vLLM, as `check_*` rows.
Prints seconds, bytes, GB/s and each path's ratio to the baseline; writes bench/results/weight_sync.json.
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


def checked_push(client, buckets, version: int) -> None:
    """A push with the post-sync check: digests while streaming, then the engine's, compared."""
    from stacx.rollout.weight_check import DigestingBuckets, verify_engine_weights

    digesting = DigestingBuckets(buckets, dtype=client.weight_digest_dtype())
    client.update_weights(digesting, version=version)
    report = verify_engine_weights(client, digesting.digests, url=client.url, version=version)
    assert report["unverified"] == 0, report


def vllm_rows(args, model, groups, buckets) -> dict:
    """vllm_shm (a push) and check_vllm (the post-sync check's extra time) against a vLLM server serving the
    same weights, written as a Hugging Face folder (fp32)."""
    import tempfile

    from stacx.models import export_hf_checkpoint
    from stacx.rollout.engines.vllm import VllmEngine, VllmServerProcess
    from stacx.rollout.tokenizer import build_char_tokenizer

    folder = tempfile.mkdtemp(prefix="weight-sync-vllm-")
    export_hf_checkpoint(model, folder, groups)
    build_char_tokenizer().save_pretrained(folder)  # vLLM loads a tokenizer; any will do for token ids
    server = VllmServerProcess(folder, python=args.vllm_python, timeout_s=2400)
    try:
        client = VllmEngine(server.url)
        version = iter(range(1, 10**6))
        push = best_seconds(lambda: client.update_weights(buckets, version=next(version)), args.repeats)
        check = best_seconds(lambda: checked_push(client, buckets, next(version)), args.repeats) - push
        client.shutdown()
    finally:
        server.stop()
    return {"vllm_shm": push, "check_vllm": check}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default=None, help="python of a vLLM environment: adds the vLLM rows")
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
            if transport == "shm":
                results["check_serve"] = best_seconds(lambda: checked_push(client, buckets, next(version)), args.repeats) \
                    - results["serve_shm"]
            client.shutdown()
    if args.vllm_python:
        results.update(vllm_rows(args, engine.model, groups, buckets))

    report = {
        "model_bytes": num_bytes, "num_tensors": len(tensors), "num_buckets": len(buckets), "bucket_mb": args.bucket_mb,
        "threads": args.threads, "repeats": args.repeats, "python": sys.version.split()[0], "torch": torch.__version__,
        "machine": platform.machine(), "paths": {},
    }
    base_gbps = num_bytes / results["baseline"] / 1e9
    print(f"weights: {num_bytes / 1e6:.0f} MB in {len(tensors)} tensors, {len(buckets)} buckets of <= {args.bucket_mb} MB")
    for name, seconds in results.items():
        gbps = num_bytes / seconds / 1e9
        report["paths"][name] = {"seconds": seconds, "bytes": num_bytes, "GB_per_s": gbps,
                                 "ratio_to_copy": gbps / base_gbps}
        print(f"{name:>11}: {seconds * 1e3:8.1f} ms  {num_bytes} bytes  {gbps:6.2f} GB/s  "
              f"ratio to copy {gbps / base_gbps:5.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
