"""Hugging Face safetensors <-> a TP-sharded megatron GPTModel.

- `load_hf_checkpoint(model, path, groups)`: each rank reads only the rows/columns of each HF
  tensor its TP shard needs (safetensors slices; sharded `model.safetensors.index.json` too).
- `iter_hf_weight_buckets(model, groups, bucket_bytes)`: full, unpadded HF-named tensors,
  gathered over TP, yielded in lists of about `bucket_bytes` (weight sync to inference engines).
- `export_hf_checkpoint(model, out_dir, groups, hf_config)`: rank 0 writes those buckets as
  safetensors shards plus config.json; the folder loads with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
import torch.distributed as dist

from stacx.models.architectures import decoder_shape, load_hf_config
from stacx.models.builder import hf_config_of, model_chunks, unwrap_model
from stacx.models.lora import adapter_param_mappings, merged_weight
from stacx.models.value_head_names import value_head_tensor_names
from stacx.models.weight_mapping import (
    IGNORED_HF_SUFFIXES,
    expected_param_mappings,
    holds_tied_head_copy,
    param_mappings,
)
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.pipeline import stream_to_first_stage

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
VALUE_HEAD_REPLACES = "output_layer.weight"
"""The language-model head's parameter, which a critic's value head replaces (never read into a critic)."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensor names or shapes do not match the model's config."""


class CheckpointNotFoundError(FileNotFoundError):
    """A checkpoint path is not a local Hugging Face folder; the message names the flag and the path."""


def require_hf_checkpoint_folder(path: str | os.PathLike, *, flag: str = "--hf-checkpoint") -> str:
    """`path` (as a string) once it is a local folder holding config.json; else CheckpointNotFoundError at once.

    Stacx reads checkpoints only from local folders (each tensor-parallel rank reads its slices of
    the safetensors files), so a name that is not a folder is never handed to `transformers`, which
    would take it for a Hub model id and spend about a minute on download retries before reporting
    a network error instead of the missing folder.
    """
    path = os.fspath(path)
    where = f"{flag} {path}"
    if not path:
        raise CheckpointNotFoundError(f"{flag} is empty; give a Hugging Face checkpoint folder")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            f"{where}: folder not found (looked for {os.path.abspath(path)}). Stacx reads checkpoints from local "
            f"folders only: fix the path, or download a Hub model to a folder first (for example "
            f"huggingface_hub.snapshot_download(repo_id, local_dir=DIR)) and pass that folder")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{where}: is a file, not a folder; pass the folder that holds config.json")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFoundError(f"{where}: the folder has no config.json, so it is not a Hugging Face "
                                      f"checkpoint; pass the folder that holds config.json and the safetensors")
    return path


def hf_weight_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from an index file or the single-file layout of folder `path`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint folder not found: {path}")
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index_path} names {os.path.basename(file)}, which does not exist")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {SAFETENSORS_INDEX} in {path}")


def _check_names(mappings, files: dict[str, str], shape, path: str, *, value_head: bool = False) -> None:
    needed = {name for m in mappings for name in m.hf_names}
    missing = sorted(needed - set(files))
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {path} has no tensor {missing[0]!r} that the config needs"
            + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    tolerated = {"lm_head.weight"} if shape.tie_word_embeddings or value_head else set()
    if value_head:  # a critic replaces the language-model head; a value head of the folder is read apart
        tolerated |= value_head_tensor_names()
    # A rank holds num_experts / ep routed experts: the other ranks' experts are described too.
    tolerated |= {_renumber_expert(name, expert - _expert_index(name)) for m in mappings if m.routed_expert
                  for name in m.hf_names for expert in range(shape.moe.num_experts)}
    unexpected = sorted(
        name for name in set(files) - needed
        if name not in tolerated and not name.endswith(IGNORED_HF_SUFFIXES)
    )
    if unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {path} has tensor {unexpected[0]!r} that the config does not describe"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )


class HFTensorReader:
    """Reads whole tensors or row/column slices from a folder's safetensors files, checking shapes."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.files = hf_weight_files(self.path)
        self._handles: dict[str, object] = {}

    def read(self, hf_name: str, expected_shape, part) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[hf_name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt", device="cpu")
        tensor_slice = self._handles[file].get_slice(hf_name)
        found = tuple(tensor_slice.get_shape())
        if found != tuple(expected_shape):
            raise CheckpointMismatchError(
                f"tensor {hf_name!r} in {os.path.basename(file)} has shape {list(found)}, "
                f"the config expects {list(expected_shape)}"
            )
        if part.dim is None:
            return tensor_slice[:]
        if part.dim == 0:
            return tensor_slice[part.start : part.stop]
        return tensor_slice[:, part.start : part.stop]

    def read_local_shard(self, mapping, shape, tp_rank: int, tp_size: int) -> torch.Tensor:
        """The megatron shard of `mapping` for `tp_rank` of `tp_size` (the expert tensor-parallel rank and
        size for a routed expert: `mapping.shard_rank_and_size`), reading only the needed slices."""
        pieces = [
            self.read(hf_name, expected, part)
            for hf_name, expected, part in zip(
                mapping.hf_names, mapping.hf_shapes(shape, tp_size), mapping.local_slices(shape, tp_rank, tp_size)
            )
        ]
        return mapping.assemble_local(pieces, shape, tp_size)

    def check_names(self, mappings, shape, *, value_head: bool = False) -> None:
        _check_names(mappings, self.files, shape, self.path, value_head=value_head)


@torch.no_grad()
def load_hf_checkpoint(model, path: str, groups: ProcessGroups, *, value_head: bool = False) -> None:
    """Copy a Hugging Face safetensors checkpoint into `model`'s TP shard, reading only that shard.

    `value_head`: the model is a critic's decoder, whose language-model head a value head replaces: the folder's
    `lm_head.weight` is not needed (a *ForTokenClassification folder has none) and not read, and the folder's value
    head (`stacx.models.value_head_weights`) is left for the critic to read. Raises FileNotFoundError for a
    missing folder/file and CheckpointMismatchError naming the first tensor whose name or shape does not match
    the model's config.
    """
    chunks = [unwrap_model(chunk) for chunk in model_chunks(model)]
    shape = decoder_shape(hf_config_of(chunks[0]))
    reader = HFTensorReader(path)
    # A pipeline stage holds some of the layers: the checkpoint is checked against the whole model.
    whole_model = param_mappings(chunks[0]) if groups.pp_size == 1 else expected_param_mappings(shape, groups.tp_size)
    if value_head:
        whole_model = [m for m in whole_model if m.megatron_name != VALUE_HEAD_REPLACES]
    reader.check_names(whole_model, shape, value_head=value_head)
    for gpt in chunks:
        params = dict(gpt.named_parameters())
        for mapping in param_mappings(gpt):
            if value_head and mapping.megatron_name == VALUE_HEAD_REPLACES:
                continue
            rank, size = mapping.shard_rank_and_size(groups)
            params[mapping.megatron_name].copy_(reader.read_local_shard(mapping, shape, rank, size))


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's `tensor` of `group` (of `size` ranks), in rank order."""
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor, group=group)
    return shards


def _gather_tp(tensor: torch.Tensor, groups: ProcessGroups, only_to_tp_rank: int | None) -> list[torch.Tensor] | None:
    """Every TP rank's shard, on every TP rank (all-gather) or only on `only_to_tp_rank` (gather; None elsewhere)."""
    if groups.tp_size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    if only_to_tp_rank is None:
        return _all_gather(tensor, groups.tp, groups.tp_size)
    receiving = groups.tp_rank == only_to_tp_rank
    shards = [torch.empty_like(tensor) for _ in range(groups.tp_size)] if receiving else None
    dist.gather(tensor, shards, group_dst=only_to_tp_rank, group=groups.tp)
    return shards


@torch.no_grad()
def iter_hf_weight_buckets(
    model, groups: ProcessGroups, bucket_bytes: int, dtype: torch.dtype | None = None, *, only_to_tp_rank: int | None = None,
    adapters: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (hf_name, full unpadded tensor) of about `bucket_bytes` each, in a fixed order.

    Every rank of the model's TP group must iterate (each parameter is gathered over TP); with
    expert parallelism (ep > 1) every rank of the expert-parallel group too, since each routed expert
    is gathered over etp and then over ep (so every rank's experts come out, under their global
    Hugging Face names). By
    default every TP rank receives the same buckets; with `only_to_tp_rank` only that TP rank
    receives the shards (half the traffic at tp=2) and yields buckets, while the other TP ranks
    take part in the gathers and yield nothing (they must still exhaust the iterator). A tensor larger than `bucket_bytes` is a bucket alone. `dtype` converts the
    tensors (default: the parameters' own dtype). A linear with a LoRA adapter yields its merged weight
    W + scale * B A; `adapters=True` yields the adapters instead, under PEFT's names
    (`stacx.models.lora.adapter_param_mappings`).
    """
    # Under PP each stage gathers its own layers over TP (chunk by chunk with virtual stages); the first
    # stage receives the others' in stage order.
    own = (pair for chunk in model_chunks(model)
           for pair in _iter_hf_tensors(unwrap_model(chunk), groups, dtype, only_to_tp_rank, adapters))
    named = stream_to_first_stage(own, groups)
    yield from split_into_buckets(named, bucket_bytes)


def _iter_hf_tensors(gpt, groups: ProcessGroups, dtype, only_to_tp_rank, adapters=False) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) one parameter at a time, gathered over TP as the caller iterates."""
    shape = decoder_shape(hf_config_of(gpt))
    params = dict(gpt.named_parameters())
    if adapters:
        mappings = adapter_param_mappings(gpt)
    else:
        mappings = param_mappings(gpt)
        params = {name: merged_weight(gpt, name, param) for name, param in params.items()}
    for mapping in mappings:
        if holds_tied_head_copy(gpt) and mapping.megatron_name == "output_layer.weight":
            continue  # the first stage sends the embedding, which Hugging Face stores once
        if mapping.routed_expert:
            named = _routed_expert_hf_tensors(mapping, params[mapping.megatron_name].detach(), groups, shape)
            if only_to_tp_rank is None or groups.tp_rank == only_to_tp_rank:
                for hf_name, tensor in named:
                    yield hf_name, (tensor.contiguous() if dtype is None else tensor.to(dtype).contiguous())
            continue
        shards = _gather_tp(params[mapping.megatron_name].detach(), groups, only_to_tp_rank)
        if shards is None:  # a non-receiving rank only takes part in the gathers
            continue
        shards = [s.cpu() for s in shards]
        for hf_name, tensor in zip(mapping.hf_names, mapping.merge_shards(shards, shape)):
            yield hf_name, (tensor.contiguous() if dtype is None else tensor.to(dtype).contiguous())


def _routed_expert_hf_tensors(mapping, param: torch.Tensor, groups: ProcessGroups, shape) -> list[tuple[str, torch.Tensor]]:
    """One local expert's weight as full HF tensors from every expert-parallel rank: gathered over etp,
    merged, then gathered over ep (EP rank r holds experts [r * E/ep, (r+1) * E/ep))."""
    shards = [s.cpu() for s in _all_gather(param, groups.etp, groups.etp_size)]
    merged = mapping.merge_shards(shards, shape)
    experts_per_rank = shape.moe.num_experts // groups.ep_size
    named = []
    for hf_name, tensor in zip(mapping.hf_names, merged):
        for ep_rank, expert_tensor in enumerate(_all_gather(tensor, groups.ep, groups.ep_size)):
            named.append((_renumber_expert(hf_name, (ep_rank - groups.ep_rank) * experts_per_rank), expert_tensor))
    return named


def _expert_index(hf_name: str) -> int:
    """e of `...mlp.experts.{e}.rest`."""
    return int(hf_name.split(".mlp.experts.", 1)[1].split(".", 1)[0])


def _renumber_expert(hf_name: str, shift: int) -> str:
    """`...mlp.experts.{e}.rest` -> `...mlp.experts.{e + shift}.rest`."""
    head, rest = hf_name.split(".mlp.experts.", 1)
    expert, tail = rest.split(".", 1)
    return f"{head}.mlp.experts.{int(expert) + shift}.{tail}"


def split_into_buckets(named_tensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group an iterable of (name, tensor) into lists of at most `bucket_bytes` (a tensor larger
    than the budget gets a bucket of its own). Lazy: consumes the input one tensor at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def config_dtype(config) -> torch.dtype | None:
    """The checkpoint dtype a Hugging Face config declares (`dtype`, formerly `torch_dtype`), or None."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")
"""Files of a Hugging Face folder that belong with the weights for the folder to be usable on its own."""


def copy_tokenizer_files(source: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy the TOKENIZER_FILES present in folder `source` into `out_dir`; returns their names.

    Contents only: each copy is a new file with the umask's mode, not the source's (which may be 0600)."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
            copied.append(name)
    return copied


def export_hf_checkpoint(model, out_dir: str, groups: ProcessGroups, hf_config=None, *, max_shard_bytes: int = 5 * 1024**3,
                         tokenizer_from: str | None = None,
                         value_head: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write the model as a Hugging Face checkpoint (safetensors shards + index + config.json).

    Call on every rank. Ranks with cp_rank == dp_rank == 0 gather over TP (every rank when experts are
    spread over ep > 1: each holds experts no other rank of its TP group has); global rank 0 writes.
    Tensors are written in the config's `dtype` (else the parameters' dtype), vocab padding
    stripped. `tokenizer_from`: a folder (the checkpoint the model started from) whose tokenizer
    files are copied next to the weights, so the export loads, serves and evaluates on its own.
    `value_head` (weight [1, hidden], bias [1]): the model is a critic's decoder; its language-model head is not
    written, the head is, as `score.weight` and `score.bias` with the family's *ForTokenClassification config and
    num_labels 1 (`stacx.models.value_head_weights`), which AutoModelForTokenClassification loads.
    Returns after the files exist on every rank (a barrier when distributed).
    """
    config = load_hf_config(hf_config) if hf_config is not None else hf_config_of(model)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    if (groups.cp_rank == 0 and groups.dp_rank == 0) or groups.ep_size > 1:
        if is_writer:
            os.makedirs(out_dir, exist_ok=True)
        shard_files: list[tuple[str, list[str]]] = []
        buckets = iter_hf_weight_buckets(model, groups, max_shard_bytes, dtype=config_dtype(config), only_to_tp_rank=0)
        if value_head is not None:
            buckets = _with_value_head(buckets, value_head, config_dtype(config))
        for number, bucket in enumerate(buckets):
            if is_writer:
                file = f"model-{number + 1:05d}.safetensors"
                _save_safetensors(dict(bucket), os.path.join(out_dir, file))
                shard_files.append((file, [name for name, _ in bucket]))
        if is_writer:
            _write_index_and_config(out_dir, shard_files, config, value_head=value_head is not None)
            if tokenizer_from is not None:
                copy_tokenizer_files(tokenizer_from, out_dir)
    if dist.is_initialized():
        dist.barrier()


def _with_value_head(buckets, value_head: tuple[torch.Tensor, torch.Tensor], dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`buckets` without the language-model head, then one bucket holding the value head under EXPORT_NAMES."""
    from stacx.models.value_head_names import EXPORT_NAMES

    for bucket in buckets:
        kept = [(name, tensor) for name, tensor in bucket if name != "lm_head.weight"]
        if kept:
            yield kept
    weight, bias = (t.detach().cpu().contiguous() if dtype is None else t.detach().cpu().to(dtype).contiguous()
                    for t in value_head)
    yield [(EXPORT_NAMES.weight, weight), (EXPORT_NAMES.bias, bias)]


def current_umask() -> int:
    """This process's file-mode creation mask (Linux reports it in /proc; elsewhere set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _save_safetensors(tensors: dict[str, torch.Tensor], file: str) -> None:
    from safetensors.torch import save_file

    save_file(tensors, file, metadata={"format": "pt"})
    # safetensors writes a private (0600) temporary and renames it into place; give the file the mode
    # any other new file gets (0666 less the umask), so that those who may read config.json may read this.
    os.chmod(file, 0o666 & ~current_umask())


def _write_index_and_config(out_dir: str, shard_files, config, *, value_head: bool = False) -> None:
    from stacx.models.architectures import ARCHITECTURES
    from stacx.models.hf_config import as_transformers_config

    if len(shard_files) == 1:
        os.replace(os.path.join(out_dir, shard_files[0][0]), os.path.join(out_dir, SINGLE_FILE))
    else:
        count = len(shard_files)
        weight_map, total = {}, 0
        for number, (file, names) in enumerate(shard_files):
            final = f"model-{number + 1:05d}-of-{count:05d}.safetensors"
            os.replace(os.path.join(out_dir, file), os.path.join(out_dir, final))
            weight_map.update({name: final for name in names})
            total += os.path.getsize(os.path.join(out_dir, final))
        with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = as_transformers_config(config)
    config.architectures = [ARCHITECTURES[config.model_type].hf_class_name]
    if value_head:
        from stacx.models.value_head_names import token_classification_config

        config = token_classification_config(config)
    config.save_pretrained(out_dir)
