"""What kind of model folder a flag names, and loading its weights into a built model.

    kind = detect_model_folder(path, flag="--ref-load")      # "hf" or "torch_dist"
    load_model_weights(model, path, groups, flag="--ref-load")

Two layouts hold a model's weights:
    Hugging Face   config.json + model.safetensors (or model.safetensors.index.json and its shards)
    torch_dist     metadata.json ({"sharded_backend": "torch_dist"}) + .metadata + __*_*.distcp,
                   megatron-core's distributed checkpoint (`<model>_torch_dist` in the Megatron-based
                   RL frameworks; `stacx convert hf-to-torch-dist` writes one)
A torch_dist folder is read in either of two arrangements:
    flat           the files above in the folder itself (megatron-core's `dist_checkpointing.save`)
    Megatron-LM    latest_checkpointed_iteration.txt + iter_0000100/ (or release/) holding them, as
                   Megatron-LM's `save_checkpoint` and the converters built on it write; the tracker
                   file names the iteration (an integer, or `release`), `resolve_torch_dist_folder`
                   finds its folder. Such a folder has no config.json: the model's comes from
                   --hf-checkpoint.
A folder that is neither gets an error naming both. The retired `stacx-megatron-tp` folders
(`stacx_model.json`) get a message naming the conversion that replaces them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stacx.checkpointing.torch_dist import TORCH_DIST_BACKEND, is_torch_dist_folder
from stacx.parallel.groups import ProcessGroups

HF = "hf"
TORCH_DIST = "torch_dist"
RETIRED_STACX_METADATA = "stacx_model.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker: the iteration of the newest checkpoint in the folder, or `release`."""
RELEASE_DIR = "release"

EXPECTED_LAYOUTS = (
    "a Hugging Face folder (config.json with model.safetensors or model.safetensors.index.json) or a "
    f"torch_dist folder (metadata.json naming sharded_backend {TORCH_DIST_BACKEND!r}, .metadata and "
    "__*_*.distcp files, as `stacx convert hf-to-torch-dist` writes, or Megatron-LM's "
    f"{TRACKER_FILE} with the iter_NNNNNNN/ or release/ folder holding them)")


class ModelFolderError(ValueError):
    """A folder given as a model checkpoint is neither layout Stacx reads; the message names the flag."""


def _is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file())


def retired_format_message(path: str | os.PathLike, flag: str) -> str:
    return (f"{flag} {path}: this is a model folder in the retired 'stacx-megatron-tp' format ({RETIRED_STACX_METADATA}), "
            "which this Stacx no longer reads. Use the Hugging Face folder it was converted from, or convert that "
            "folder to torch_dist with `stacx convert hf-to-torch-dist --hf-checkpoint HF_DIR --out DIR`")


def iteration_folder_name(iteration: int) -> str:
    """Megatron-LM's name for the folder of checkpoint `iteration` (`iter_0000100`)."""
    return f"iter_{iteration:07d}"


def resolve_torch_dist_folder(path: str | os.PathLike, *, flag: str) -> Path:
    """The folder holding the torch_dist files of `path`: `path` itself (flat), or the iteration folder
    that Megatron-LM's tracker file names. ModelFolderError naming the tracker when it names nothing usable."""
    folder = Path(path)
    tracker = folder / TRACKER_FILE
    if not tracker.is_file():
        return folder
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ModelFolderError(f"{flag} {path}: {TRACKER_FILE} cannot be read ({err})") from None
    if text == RELEASE_DIR:
        target = folder / RELEASE_DIR
    elif text.isdigit():
        target = folder / iteration_folder_name(int(text))
    else:
        raise ModelFolderError(f"{flag} {path}: {TRACKER_FILE} holds {text[:40]!r}, not an iteration number or "
                               f"{RELEASE_DIR!r}; write the iteration whose iter_NNNNNNN folder holds the weights")
    if not is_torch_dist_folder(target):
        present = sorted(p.name for p in folder.iterdir() if p.is_dir() and (p.name.startswith("iter_")
                                                                             or p.name == RELEASE_DIR))
        what = "does not exist" if not target.is_dir() else "is not a complete torch_dist checkpoint"
        raise ModelFolderError(
            f"{flag} {path}: {TRACKER_FILE} names {text!r}, but {target.name}/ {what} (its folders: "
            f"{', '.join(present) or 'none'}). Point the tracker at a complete iteration, or pass that "
            f"iteration's folder itself (Stacx reads Megatron-LM checkpoints saved as torch_dist only)")
    return target


def detect_model_folder(path: str | os.PathLike, *, flag: str) -> str:
    """HF or TORCH_DIST for a folder holding a model in either layout; ModelFolderError otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"{flag} {path}: folder not found (looked for {folder.absolute()}); expected "
                               f"{EXPECTED_LAYOUTS}")
    if is_torch_dist_folder(folder):
        return TORCH_DIST
    if (folder / TRACKER_FILE).is_file():
        resolve_torch_dist_folder(folder, flag=flag)
        return TORCH_DIST
    if _is_hf_folder(folder):
        return HF
    if (folder / RETIRED_STACX_METADATA).is_file():
        raise ModelFolderError(retired_format_message(path, flag))
    if (folder / "manifest.json").is_file() and (folder / "roles").is_dir():
        roles = sorted(p.name for p in (folder / "roles").iterdir() if p.is_dir())
        raise ModelFolderError(f"{flag} {path}: a training checkpoint's step folder, not a model folder; pass one "
                               f"role's weights, {folder}/roles/ROLE/model (its roles: {', '.join(roles)})")
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
    """Whether `path` holds a model in either layout, or a PEFT adapter folder (a LoRA run's start adapters), rather
    than, say, a training checkpoint's root."""
    from stacx.models.lora import is_peft_adapter_folder

    folder = Path(path)
    return folder.is_dir() and (is_torch_dist_folder(folder) or _is_hf_folder(folder)
                                or (folder / TRACKER_FILE).is_file() or is_peft_adapter_folder(folder))


def load_model_weights(model, path: str | os.PathLike, groups: ProcessGroups, *, flag: str,
                       value_head: bool = False) -> str:
    """Copy the weights of folder `path` (either layout, detected) into `model`'s shard; returns the kind.

    `value_head`: `model` is a critic's decoder, loaded without its language-model head (a value head replaces
    it: `read_value_head_weights`). Collective over the model's world for a torch_dist folder (every rank reads
    its own chunks)."""
    kind = detect_model_folder(path, flag=flag)
    if kind == HF:
        from stacx.models.checkpoint import load_hf_checkpoint

        load_hf_checkpoint(model, os.fspath(path), groups, value_head=value_head)
    else:
        from stacx.checkpointing.torch_dist import load_torch_dist

        load_torch_dist(resolve_torch_dist_folder(path, flag=flag), model, what=flag, value_head=value_head)
    return kind


def read_value_head_weights(path: str | os.PathLike, hidden_size: int, *, flag: str,
                            dtype=None) -> tuple[object, object, str] | None:
    """(weight [1, hidden], bias [1], where it was found) of the value head that folder `path` holds, or None:
    a Stacx critic's torch_dist folder (`stacx.checkpointing.value_head`) or a Hugging Face folder with a value
    head under a name of `stacx.models.value_head_weights`. Collective over the default group for torch_dist."""
    import torch

    dtype = dtype or torch.float32
    if detect_model_folder(path, flag=flag) == HF:
        from stacx.models.value_head_weights import read_hf_value_head

        head = read_hf_value_head(path, hidden_size)
        if head is None:
            return None
        return (head.weight.to(dtype), head.bias.to(dtype),
                f"{head.names.weight} and {head.names.bias} ({head.names.written_by})")
    from stacx.checkpointing.value_head import VALUE_HEAD_BIAS, VALUE_HEAD_WEIGHT, read_torch_dist_value_head

    head = read_torch_dist_value_head(resolve_torch_dist_folder(path, flag=flag), hidden_size, dtype=dtype)
    if head is None:
        return None
    return head[0], head[1], f"{VALUE_HEAD_WEIGHT} and {VALUE_HEAD_BIAS} (a Stacx critic's torch_dist folder)"


__all__ = [
    "EXPECTED_LAYOUTS",
    "HF",
    "ModelFolderError",
    "RELEASE_DIR",
    "TORCH_DIST",
    "TRACKER_FILE",
    "detect_model_folder",
    "is_model_folder",
    "iteration_folder_name",
    "load_model_weights",
    "read_value_head_weights",
    "resolve_torch_dist_folder",
    "retired_format_message",
]
