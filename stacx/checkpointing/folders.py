"""What kind of model folder a flag names, and loading its weights into a built model.

    kind = detect_model_folder(path, flag="--ref-load")      # "hf" or "torch_dist"
    load_model_weights(model, path, groups, flag="--ref-load")

Two layouts hold a model's weights:
    Hugging Face   config.json + model.safetensors (or model.safetensors.index.json and its shards)
    torch_dist     metadata.json ({"sharded_backend": "torch_dist"}) + .metadata + __*_*.distcp,
                   megatron-core's distributed checkpoint (`<model>_torch_dist` in the Megatron-based
                   RL frameworks; `stacx convert hf-to-torch-dist` writes one)
A folder that is neither gets an error naming both. The retired `stacx-megatron-tp` folders
(`stacx_model.json`) get a message naming the conversion that replaces them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stacx.checkpointing.torch_dist import TORCH_DIST_BACKEND, is_torch_dist_folder

HF = "hf"
TORCH_DIST = "torch_dist"
RETIRED_STACX_METADATA = "stacx_model.json"

EXPECTED_LAYOUTS = (
    "a Hugging Face folder (config.json with model.safetensors or model.safetensors.index.json) or a "
    f"torch_dist folder (metadata.json naming sharded_backend {TORCH_DIST_BACKEND!r}, .metadata and "
    "__*_*.distcp files, as `stacx convert hf-to-torch-dist` writes)")


class ModelFolderError(ValueError):
    """A folder given as a model checkpoint is neither layout Stacx reads; the message names the flag."""


def _is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file())


def retired_format_message(path: str | os.PathLike, flag: str) -> str:
    return (f"{flag} {path}: this is a model folder in the retired 'stacx-megatron-tp' format ({RETIRED_STACX_METADATA}), "
            "which this Stacx no longer reads. Use the Hugging Face folder it was converted from, or convert that "
            "folder to torch_dist with `stacx convert hf-to-torch-dist --hf-checkpoint HF_DIR --out DIR`")


def detect_model_folder(path: str | os.PathLike, *, flag: str) -> str:
    """HF or TORCH_DIST for a folder holding a model in either layout; ModelFolderError otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"{flag} {path}: folder not found (looked for {folder.absolute()}); expected "
                               f"{EXPECTED_LAYOUTS}")
    if is_torch_dist_folder(folder):
        return TORCH_DIST
    if _is_hf_folder(folder):
        return HF
    if (folder / RETIRED_STACX_METADATA).is_file():
        raise ModelFolderError(retired_format_message(path, flag))
    if (folder / "metadata.json").is_file():
        try:
            backend = json.loads((folder / "metadata.json").read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            backend = None
        if backend and backend != TORCH_DIST_BACKEND:
            raise ModelFolderError(f"{flag} {path}: a distributed checkpoint with backend {backend!r}; Stacx reads "
                                   f"{TORCH_DIST_BACKEND!r} only. Re-save it as torch_dist, or pass {EXPECTED_LAYOUTS}")
    raise ModelFolderError(f"{flag} {path}: this folder holds neither model layout Stacx reads; expected "
                           f"{EXPECTED_LAYOUTS}")


def is_model_folder(path: str | os.PathLike) -> bool:
    """Whether `path` holds a model in either layout (rather than, say, a training checkpoint's root)."""
    folder = Path(path)
    return folder.is_dir() and (is_torch_dist_folder(folder) or _is_hf_folder(folder))


def load_model_weights(model, path: str | os.PathLike, groups, *, flag: str) -> str:
    """Copy the weights of folder `path` (either layout, detected) into `model`'s shard; returns the kind.

    Collective over the model's world for a torch_dist folder (every rank reads its own chunks)."""
    kind = detect_model_folder(path, flag=flag)
    if kind == HF:
        from stacx.models.checkpoint import load_hf_checkpoint

        load_hf_checkpoint(model, os.fspath(path), groups)
    else:
        from stacx.checkpointing.torch_dist import load_torch_dist

        load_torch_dist(path, model, what=flag)
    return kind


__all__ = [
    "EXPECTED_LAYOUTS",
    "HF",
    "ModelFolderError",
    "TORCH_DIST",
    "detect_model_folder",
    "is_model_folder",
    "load_model_weights",
    "retired_format_message",
]
