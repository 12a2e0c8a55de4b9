"""Bytes and seconds of a weight push into the CPU engine: LoRA adapters only against the full (merged) weights.

    python bench/lora_sync.py                       # tiny Qwen3 and the M shape, rank 8, all-linear
    python bench/lora_sync.py --shapes M --rank 16 --targets linear_qkv linear_proj

In one process: a trainer-side model with adapters streams its buckets (`iter_hf_weight_buckets`, adapters=True
or merged) straight into a `CpuEngine` (`update_weights`, no HTTP): an engine built with the same LoRA settings
takes the adapters and merges them (`MergedAdapters`), a plain one the merged weights. Seconds are the median of
`--repeats` pushes, streaming included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for path in (BENCH_DIR, os.path.dirname(BENCH_DIR)):
    if path not in sys.path:
        sys.path.insert(0, path)

from lora_memory import CPU_SHAPES, VOCAB  # noqa: E402

BUCKET_BYTES = 64 << 20


def push(engine, model, groups, adapters: bool, version: int) -> tuple[int, float]:
    from stacx.models import iter_hf_weight_buckets

    sent = [0]

    def counted():
        for bucket in iter_hf_weight_buckets(model, groups, BUCKET_BYTES, adapters=adapters):
            sent[0] += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket

    start = time.perf_counter()
    engine.update_weights(counted(), version=version)
    return sent[0], time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "M"], choices=list(CPU_SHAPES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["all-linear"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import LoraSettings, attach_lora
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout

    settings = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=tuple(args.targets))
    for shape in args.shapes:
        arch, fields = CPU_SHAPES[shape]
        with tempfile.TemporaryDirectory() as folder:
            save_tiny_hf_checkpoint(folder, arch, seed=0, vocab_size=VOCAB, **fields)
            groups = ensure_single_process_layout()
            trainer = build_model(folder, groups, initialize_weights=False)
            load_hf_checkpoint(trainer, folder, groups)
            attach_lora(trainer, settings, groups)
            with torch.no_grad():
                for name, param in trainer.named_parameters():
                    if name.endswith("lora_b"):
                        param.normal_(0.0, 0.01)
            engines = {True: CpuEngine.from_hf_checkpoint(folder, lora=settings), False: CpuEngine.from_hf_checkpoint(folder)}
            for adapters in (False, True):
                runs = [push(engines[adapters], trainer, groups, adapters, version) for version in range(1, args.repeats + 1)]
                sent = runs[0][0]
                seconds = statistics.median(s for _, s in runs)
                print(f"{shape:5s} {'adapters' if adapters else 'full    '} {sent / 2**20:9.3f} MiB  {seconds * 1000:8.1f} ms",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
