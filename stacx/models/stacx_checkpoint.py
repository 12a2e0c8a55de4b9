"""Stacx's TP-sharded model checkpoint, and conversion to and from Hugging Face without a model.

A Stacx model folder holds:
    stacx_model.json             {"format": "stacx-megatron-tp", "version": 1, "tensor_model_parallel_size": N}
    config.json                  the Hugging Face config (real vocab size)
    tp_rank_00.safetensors ...   each TP rank's megatron parameters, by megatron name

`convert_hf_to_stacx` / `convert_stacx_to_hf` work in one process from the config alone
(`expected_param_mappings`); `save_stacx_model` / `load_stacx_model` let TP ranks of a live
model write or read their own file.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from stacx.models.architectures import check_tensor_parallel_size, decoder_shape, load_hf_config
from stacx.models.builder import hf_config_of, unwrap_model
from stacx.models.checkpoint import (
    SAFETENSORS_INDEX,
    SINGLE_FILE,
    CheckpointMismatchError,
    HFTensorReader,
    config_dtype,
    _write_index_and_config,
)
from stacx.models.weight_mapping import expected_param_mappings, param_mappings

METADATA_FILE = "stacx_model.json"
FORMAT_NAME = "stacx-megatron-tp"


def _shard_file(folder: str, tp_rank: int) -> str:
    return os.path.join(folder, f"tp_rank_{tp_rank:02d}.safetensors")


def read_stacx_metadata(folder: str) -> dict:
    path = os.path.join(folder, METADATA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"not a Stacx model folder: {path} does not exist")
    with open(path) as f:
        metadata = json.load(f)
    if metadata.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format {metadata.get('format')!r} is not {FORMAT_NAME!r}")
    return metadata


def _write_metadata(folder: str, tp_size: int, config) -> None:
    with open(os.path.join(folder, METADATA_FILE), "w") as f:
        json.dump({"format": FORMAT_NAME, "version": 1, "tensor_model_parallel_size": tp_size}, f, indent=2)
    config.save_pretrained(folder)


def convert_hf_to_stacx(hf_dir: str, out_dir: str, tp_size: int) -> None:
    """Split a Hugging Face checkpoint into `tp_size` Stacx shard files (one process, slice reads)."""
    from safetensors.torch import save_file

    config = load_hf_config(hf_dir)
    shape = decoder_shape(config)
    check_tensor_parallel_size(shape, tp_size)
    mappings = expected_param_mappings(shape, tp_size)
    reader = HFTensorReader(hf_dir)
    reader.check_names(mappings, shape)
    os.makedirs(out_dir, exist_ok=True)
    for tp_rank in range(tp_size):
        shard = {m.megatron_name: reader.read_local_shard(m, shape, tp_rank, tp_size).contiguous() for m in mappings}
        save_file(shard, _shard_file(out_dir, tp_rank), metadata={"format": "pt"})
    _write_metadata(out_dir, tp_size, config)


def convert_stacx_to_hf(stacx_dir: str, out_dir: str, *, max_shard_bytes: int = 5 * 1024**3) -> None:
    """Merge a Stacx model folder's TP shards into a Hugging Face checkpoint (vocab padding stripped)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tp_size = int(read_stacx_metadata(stacx_dir)["tensor_model_parallel_size"])
    config = load_hf_config(stacx_dir)
    shape = decoder_shape(config)
    files = [_shard_file(stacx_dir, r) for r in range(tp_size)]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"Stacx shard missing: {file}")
    handles = [safe_open(file, framework="pt") for file in files]
    dtype = config_dtype(config)
    os.makedirs(out_dir, exist_ok=True)
    shard_files, bucket, size = [], {}, 0

    def flush():
        file = f"model-{len(shard_files) + 1:05d}.safetensors"
        save_file(bucket, os.path.join(out_dir, file), metadata={"format": "pt"})
        shard_files.append((file, list(bucket)))

    for mapping in expected_param_mappings(shape, tp_size):
        try:
            shards = [handle.get_tensor(mapping.megatron_name) for handle in handles]
        except Exception as err:  # safetensors raises its own error type for a missing name
            raise CheckpointMismatchError(f"Stacx shard has no tensor {mapping.megatron_name!r}: {err}") from err
        for hf_name, tensor in zip(mapping.hf_names, mapping.merge_shards(shards, shape)):
            tensor = (tensor if dtype is None else tensor.to(dtype)).contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > max_shard_bytes:
                flush()
                bucket, size = {}, 0
            bucket[hf_name] = tensor
            size += nbytes
    if bucket:
        flush()
    for stale in (SINGLE_FILE, SAFETENSORS_INDEX):
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    _write_index_and_config(out_dir, shard_files, config)


def save_stacx_model(model, folder: str, groups) -> None:
    """Each TP rank (with cp_rank == dp_rank == 0) writes its own shard; global rank 0 the metadata."""
    from safetensors.torch import save_file

    gpt = unwrap_model(model)
    if groups.cp_rank == 0 and groups.dp_rank == 0:
        os.makedirs(folder, exist_ok=True)
        tensors = {name: p.detach().cpu().contiguous() for name, p in gpt.named_parameters()}
        save_file(tensors, _shard_file(folder, groups.tp_rank), metadata={"format": "pt"})
        if groups.tp_rank == 0:
            _write_metadata(folder, groups.tp_size, hf_config_of(gpt))
    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def load_stacx_model(model, folder: str, groups) -> None:
    """Read this TP rank's shard of a Stacx model folder into `model` (same tp size required)."""
    from safetensors import safe_open

    tp_size = int(read_stacx_metadata(folder)["tensor_model_parallel_size"])
    if tp_size != groups.tp_size:
        raise ValueError(f"{folder} was saved with tensor_model_parallel_size={tp_size}, the model has {groups.tp_size}")
    gpt = unwrap_model(model)
    params = dict(gpt.named_parameters())
    with safe_open(_shard_file(folder, groups.tp_rank), framework="pt") as handle:
        names = set(handle.keys())
        for mapping in param_mappings(gpt):
            if mapping.megatron_name not in names:
                raise CheckpointMismatchError(f"{folder}: shard has no tensor {mapping.megatron_name!r}")
            tensor = handle.get_tensor(mapping.megatron_name)
            param = params[mapping.megatron_name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointMismatchError(
                    f"{folder}: tensor {mapping.megatron_name!r} has shape {list(tensor.shape)}, "
                    f"the model expects {list(param.shape)}"
                )
            param.copy_(tensor)
