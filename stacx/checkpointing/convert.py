"""Conversions between Hugging Face folders and torch_dist folders (a training checkpoint's role is one:
`stacx.trainer.checkpoint_export`).

    convert_hf_to_torch_dist(hf_dir, out_dir, tp_size=2)      # each of tp ranks reads its slices, writes its chunks
    convert_torch_dist_to_hf(dist_dir, out_dir)                # config.json + safetensors + tokenizer files
    convert_torch_dist_to_hf(dist_dir, out_dir, hf_config=hf)  # config and tokenizer from another folder

A torch_dist folder stores global tensors, so the tp a conversion runs at only decides how many
processes share the work and memory: any tp loads it. `tp_size > 1` spawns that many local gloo
ranks; tp 1 runs in this process (a one-rank world is set up when none exists).

Every Hugging Face folder written here carries the source's tokenizer files and
generation_config.json (`TOKENIZER_FILES`), so it loads with `AutoTokenizer` on its own. A
torch_dist folder written here carries them too, with the source's config.json, so it converts
back without naming the original.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from stacx.checkpointing.torch_dist import TorchDistCheckpointError, load_torch_dist, save_torch_dist
from stacx.parallel.groups import ProcessGroups


@contextlib.contextmanager
def single_process_world() -> Iterator[object]:
    """ProcessGroups of a one-rank world (gloo over an in-memory store, megatron's layout at tp=cp=1),
    torn down on exit when this call set it up; an existing one-rank world is reused as it is."""
    import torch.distributed as dist

    from stacx.parallel.groups import ProcessGroups, destroy_parallel_layout, initialize_parallel_layout
    from stacx.parallel.megatron_import import import_megatron_core

    import_megatron_core()  # conversion commands import megatron-core first here
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"a conversion in this process needs a one-rank world; torch.distributed has "
                           f"{dist.get_world_size()} ranks")
    if created or not parallel_state.model_parallel_is_initialized():
        initialize_parallel_layout(1, 1)
    try:
        yield ProcessGroups.single_process()
    finally:
        if created:
            destroy_parallel_layout()


def _require_empty_output(out_dir: str | os.PathLike, flag: str = "--out") -> None:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{flag} {out_dir}: already exists and is not empty; choose a new folder or delete it")


def _run_on_ranks(fn, tp_size: int, args: tuple) -> None:
    if tp_size == 1:
        with single_process_world() as groups:
            fn(groups, *args)
        return
    from stacx.testing.distributed import run_distributed

    run_distributed(fn, tp_size, tensor_model_parallel_size=tp_size, args=args, timeout_s=3600.0)


# ---- Hugging Face -> torch_dist ------------------------------------------------------------------


def _hf_to_torch_dist_rank(groups: ProcessGroups, hf_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from stacx.models import build_model
    from stacx.models.checkpoint import copy_tokenizer_files, load_hf_checkpoint

    model = build_model(hf_dir, groups, initialize_weights=False)
    load_hf_checkpoint(model, hf_dir, groups)
    save_torch_dist(out_dir, model, groups=groups)
    if dist.get_rank() == 0:
        shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(out_dir, "config.json"))  # umask mode
        copy_tokenizer_files(hf_dir, out_dir)
    dist.barrier()


def convert_hf_to_torch_dist(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp_size: int = 1) -> str:
    """Write Hugging Face folder `hf_dir` as a torch_dist folder `out_dir` (loads at any tp); returns it."""
    from stacx.models.architectures import check_tensor_parallel_size, decoder_shape, load_hf_config
    from stacx.models.checkpoint import require_hf_checkpoint_folder

    hf_dir = require_hf_checkpoint_folder(hf_dir)
    if tp_size < 1:
        raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {tp_size}")
    check_tensor_parallel_size(decoder_shape(load_hf_config(hf_dir)), tp_size)
    _require_empty_output(out_dir)
    _run_on_ranks(_hf_to_torch_dist_rank, tp_size, (os.fspath(hf_dir), os.fspath(out_dir)))
    return os.fspath(out_dir)


# ---- torch_dist -> Hugging Face ------------------------------------------------------------------


def _torch_dist_to_hf_rank(groups: ProcessGroups, dist_dir: str, out_dir: str, config_dir: str, what: str,
                           max_shard_bytes: int = 5 * 1024**3) -> None:
    from stacx.models import build_model
    from stacx.models.checkpoint import export_hf_checkpoint

    from stacx.checkpointing.value_head import holds_torch_dist_value_head, read_torch_dist_value_head

    model = build_model(config_dir, groups, initialize_weights=False)
    # A critic's folder: its decoder, and its value head written as *ForTokenClassification's score
    critic = holds_torch_dist_value_head(dist_dir, model.config.hidden_size)
    load_torch_dist(dist_dir, model, what=what, value_head=critic)
    value_head = read_torch_dist_value_head(dist_dir, model.config.hidden_size) if critic else None
    export_hf_checkpoint(model, out_dir, groups, config_dir, tokenizer_from=config_dir, max_shard_bytes=max_shard_bytes,
                         value_head=value_head)


def _config_source(dist_dir: str | os.PathLike, hf_config: str | os.PathLike | None, what: str) -> str:
    if hf_config is not None:
        from stacx.models.checkpoint import require_hf_checkpoint_folder

        return require_hf_checkpoint_folder(hf_config)
    if not os.path.isfile(os.path.join(dist_dir, "config.json")):
        raise TorchDistCheckpointError(
            f"{what} {dist_dir}: holds no config.json (a torch_dist folder written by another framework); pass "
            "--hf-checkpoint with the Hugging Face folder of the same model, whose config and tokenizer are used")
    return os.fspath(dist_dir)


def convert_torch_dist_to_hf(dist_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                             hf_config: str | os.PathLike | None = None, tp_size: int = 1,
                             what: str = "--load", max_shard_bytes: int = 5 * 1024**3) -> str:
    """Write torch_dist folder `dist_dir` (flat, or Megatron-LM's tracker layout) as a Hugging Face
    folder `out_dir`; returns it.

    The config, tokenizer files and generation_config.json come from `dist_dir` itself when it holds
    a config.json, else from Hugging Face folder `hf_config`."""
    from stacx.checkpointing.folders import TORCH_DIST, detect_model_folder, resolve_torch_dist_folder

    if detect_model_folder(dist_dir, flag=what) != TORCH_DIST:
        raise TorchDistCheckpointError(f"{what} {dist_dir}: is a Hugging Face folder, not torch_dist; it needs no "
                                       "conversion (or use hf-to-torch-dist)")
    config_dir = _config_source(dist_dir, hf_config, what)
    _require_empty_output(out_dir)
    files_dir = resolve_torch_dist_folder(dist_dir, flag=what)  # Megatron-LM's iter_NNNNNNN/ or release/
    _run_on_ranks(_torch_dist_to_hf_rank, tp_size,
                  (os.fspath(files_dir), os.fspath(out_dir), config_dir, what, max_shard_bytes))
    return os.fspath(out_dir)


__all__ = [
    "convert_hf_to_torch_dist",
    "convert_torch_dist_to_hf",
    "single_process_world",
]
