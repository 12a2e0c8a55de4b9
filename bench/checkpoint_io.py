"""Checkpoint I/O throughput: Stacx load/export and torch_dist save/load at TP=2 against plain safetensors.

    python bench/checkpoint_io.py [--hidden-size 1024 --layers 8 --tp 2]

Writes a random bf16 Llama-shaped checkpoint of a few hundred MB, then measures (page cache
warm for everyone):
- baseline read:  every file read into memory and deserialized by safetensors, one process;
- Stacx load:     load_hf_checkpoint on TP ranks (each reads only its slices), slowest rank;
- baseline write: safetensors.torch.save_file of the same tensors, one process;
- Stacx export:   export_hf_checkpoint (TP all-gather + merge + write on rank 0);
- torch_dist save: save_torch_dist of the TP=2 model (megatron-core dist_checkpointing, each rank
                  writes its own chunks), slowest rank; and the same plus each rank's sha256 of the
                  files it wrote (what a training checkpoint adds for its manifest);
- torch_dist load: load_torch_dist into the TP=2 model (each rank reads its chunks), slowest rank.
The torch_dist rows compare with a plain safetensors write / read of the same bytes inside the
same ranks (each rank's own parameters as one file, slowest rank), timed between them.
MB/s = checkpoint bytes / seconds. Results go to bench/results/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import torch


def make_checkpoint(folder: str, hidden_size: int, layers: int):
    from stacx.models.testing import tiny_hf_config

    config = tiny_hf_config(
        "llama", vocab_size=32000, hidden_size=hidden_size, intermediate_size=int(hidden_size * 2.75),
        num_hidden_layers=layers, num_attention_heads=hidden_size // 64, num_key_value_heads=hidden_size // 256,
        head_dim=64, dtype="bfloat16",
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="200MB")
    return config


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def read_all(folder: str) -> dict:
    """Every tensor of every file, materialized in memory (load_file alone may only map the file)."""
    from safetensors.torch import load

    tensors = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            with open(os.path.join(folder, file), "rb") as f:
                tensors.update(load(f.read()))
    return tensors


def time_stacx_load_and_export(groups, hf_dir, out_dir, dist_dir):
    import torch.distributed as dist

    from stacx.checkpointing.torch_dist import load_torch_dist, save_torch_dist
    from stacx.models import build_model, export_hf_checkpoint, load_hf_checkpoint
    from stacx.trainer.checkpoint import _sha256

    model = build_model(hf_dir, groups, params_dtype=torch.bfloat16, initialize_weights=False)
    dist.barrier()
    start = time.perf_counter()
    load_hf_checkpoint(model, hf_dir, groups)
    load_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    export_hf_checkpoint(model, out_dir, groups, hf_dir)
    export_s = time.perf_counter() - start
    times = [load_s, export_s]
    # The in-rank baseline: this rank's own parameters written and read back as one plain safetensors
    # file, timed like the torch_dist save and load below (slowest rank), interleaved with them.
    from safetensors.torch import load, save_file

    own = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    plain_file = f"{dist_dir}_plain_{dist.get_rank()}.safetensors"
    dist.barrier()
    start = time.perf_counter()
    save_file(own, plain_file)
    times.append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    with open(plain_file, "rb") as f:
        load(f.read())
    times.append(time.perf_counter() - start)
    os.remove(plain_file)
    for folder, hashed in ((dist_dir + "_a", False), (dist_dir + "_b", True)):
        dist.barrier()
        start = time.perf_counter()
        written = save_torch_dist(folder, model, groups=groups)
        if hashed:
            for name in written:
                _sha256(os.path.join(folder, name))
        times.append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    load_torch_dist(dist_dir + "_a", model)
    times.append(time.perf_counter() - start)
    dist.barrier()
    if dist.get_rank() == 0:
        for folder in (dist_dir + "_a", dist_dir + "_b"):
            shutil.rmtree(folder, ignore_errors=True)
    return tuple(times)


def main() -> None:
    from safetensors.torch import save_file

    from stacx.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for every measurement")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="stacx_bench_ckpt_")
    try:
        hf_dir, out_dir, plain_dir = (os.path.join(work, n) for n in ("hf", "export", "plain"))
        make_checkpoint(hf_dir, args.hidden_size, args.layers)
        megabytes = folder_bytes(hf_dir) / 1e6
        tensors = read_all(hf_dir)  # warms the page cache for everyone below

        read_s = min(_timed(lambda: read_all(hf_dir)) for _ in range(args.repeats))
        os.makedirs(plain_dir)
        write_s = min(_timed(lambda: save_file(tensors, os.path.join(plain_dir, "model.safetensors")))
                      for _ in range(args.repeats))
        del tensors
        # One spawn per repeat; a repeat's time is its slowest rank's.
        runs = [
            run_distributed(time_stacx_load_and_export, args.tp, tensor_model_parallel_size=args.tp,
                            args=(hf_dir, out_dir, os.path.join(work, f"dist{repeat}")), timeout_s=900)
            for repeat in range(args.repeats)
        ]
        load_s, export_s, rank_write_s, rank_read_s, dist_save_s, dist_save_hashed_s, dist_load_s = (
            min(max(rank[index] for rank in ranks) for ranks in runs) for index in range(7))
        results = {
            "checkpoint_mb": round(megabytes, 1),
            "tensor_model_parallel_size": args.tp,
            "plain_safetensors_read_mb_s": round(megabytes / read_s, 1),
            "stacx_load_mb_s": round(megabytes / load_s, 1),
            "load_ratio_vs_plain_read": round(read_s / load_s, 3),
            "plain_safetensors_write_mb_s": round(megabytes / write_s, 1),
            "stacx_export_mb_s": round(megabytes / export_s, 1),
            "export_ratio_vs_plain_write": round(write_s / export_s, 3),
            "plain_per_rank_write_mb_s": round(megabytes / rank_write_s, 1),
            "plain_per_rank_read_mb_s": round(megabytes / rank_read_s, 1),
            "torch_dist_save_mb_s": round(megabytes / dist_save_s, 1),
            "torch_dist_save_ratio_vs_plain_write": round(rank_write_s / dist_save_s, 3),
            "torch_dist_save_with_sha256_mb_s": round(megabytes / dist_save_hashed_s, 1),
            "torch_dist_save_with_sha256_ratio_vs_plain_write": round(rank_write_s / dist_save_hashed_s, 3),
            "torch_dist_load_mb_s": round(megabytes / dist_load_s, 1),
            "torch_dist_load_ratio_vs_plain_read": round(rank_read_s / dist_load_s, 3),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "torch": torch.__version__,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key, value in results.items():
        print(f"{key:32s} {value}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "checkpoint_io.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"written: {path}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
