"""Bytes and seconds of a weight push into the CPU engine: LoRA adapters only against the full (merged) weights.

    python bench/lora_sync.py                       # tiny Qwen3 and the M shape, rank 8, all-linear
    python bench/lora_sync.py --shapes M --rank 16 --targets linear_qkv linear_proj
    STACX_VLLM_PYTHON=ENV/bin/python python bench/lora_sync.py --engine vllm   # into a vLLM server instead

In one process: a trainer-side model with adapters streams its buckets (`iter_hf_weight_buckets`, adapters=True
or merged) straight into a `CpuEngine` (`update_weights`, no HTTP): an engine built with the same LoRA settings
takes the adapters and merges them (`MergedAdapters`), a plain one the merged weights. Seconds are the median of
`--repeats` pushes, streaming included. With `--engine vllm` the pushes go to a vLLM server started with LoRA on
(the tiny Llama of the `vllm` test tier, fp32; vLLM's CPU attention wants heads of 32 or more): the adapters as a
PEFT folder through `/v1/load_lora_adapter` (`VllmEngine.load_adapters`), the full weights as buckets through the
worker extension; the bytes are what each push hands the server.
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


def bench_vllm(args, settings) -> None:
    """Adapters vs full weights pushed into one vLLM server (tiny Llama), median of --repeats each."""
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import attach_lora, peft_adapter_config
    from stacx.rollout.engines.vllm import VllmEngine, VllmServerProcess, vllm_python
    from stacx.serving.cpu_engine import ensure_single_process_layout
    from stacx.tasks import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        path = write_tiny_checkpoint(os.path.join(folder, "sorting"), "sorting", num_attention_heads=2,
                                     max_position_embeddings=256)
        groups = ensure_single_process_layout()
        trainer = build_model(path, groups, initialize_weights=False)
        load_hf_checkpoint(trainer, path, groups)
        attach_lora(trainer, settings, groups)
        with torch.no_grad():
            for name, param in trainer.named_parameters():
                if name.endswith("lora_b"):
                    param.normal_(0.0, 0.01)
        server = VllmServerProcess(path, python=vllm_python(None), timeout_s=2400, lora_rank=settings.rank)
        engine = VllmEngine(server.url)
        try:
            engine.use_lora_config(peft_adapter_config(settings, base_model=None))
            version = engine.weight_version()
            for adapters in (False, True):
                runs = []
                for _ in range(args.repeats):
                    version += 1
                    runs.append(push(engine, trainer, groups, adapters, version))
                sent = runs[0][0]
                if adapters:  # the folder repeats a fused linear's A for each module: what the server reads
                    sent = sum(os.path.getsize(os.path.join(engine._lora_folder, name))
                               for name in os.listdir(engine._lora_folder))
                seconds = statistics.median(s for _, s in runs)
                print(f"vllm  {'adapters' if adapters else 'full    '} {sent / 2**20:9.3f} MiB  {seconds * 1000:8.1f} ms",
                      flush=True)
        finally:
            engine.shutdown()
            server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "M"], choices=list(CPU_SHAPES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["all-linear"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=["cpu", "vllm"], default="cpu",
                        help="push into the in-process CPU engine, or a vLLM server (STACX_VLLM_PYTHON)")
    args = parser.parse_args(argv)
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import LoraSettings, attach_lora
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout

    settings = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=tuple(args.targets))
    if args.engine == "vllm":
        bench_vllm(args, settings)
        return 0
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
