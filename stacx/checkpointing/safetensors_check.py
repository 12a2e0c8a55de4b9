"""A cheap look at a Hugging Face folder's weight files before anything loads them: each `.safetensors`
file's header parses and the file is as long as its header says (a truncated copy is caught without
reading the tensors), and every shard a `model.safetensors.index.json` names is there.

    check_safetensors_folder(path, flag="--hf-checkpoint")    # raises SafetensorsError naming the file
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""A header longer than this is not a safetensors header (the format caps it at 100 MB)."""


class SafetensorsError(ValueError):
    """A weight file of a Hugging Face folder is truncated, corrupt or missing."""


def _fix(flag: str) -> str:
    return f"copy or download the checkpoint again, or point {flag} at a complete one"


def check_safetensors_file(path: str | os.PathLike, *, flag: str) -> None:
    """The file starts with an 8-byte header length and a JSON header whose tensors' data offsets end
    within the file; SafetensorsError naming the file, its size and the fix otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{flag}: {path} has {size} bytes, too few for a safetensors header; "
                                   f"the file is truncated: {_fix(flag)}")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"{flag}: {path}: its header claims {header_bytes} bytes but the file has {size}; "
                                   f"the file is truncated or not safetensors: {_fix(flag)}")
        try:
            header = json.loads(handle.read(header_bytes))
        except ValueError as err:
            raise SafetensorsError(f"{flag}: {path}: its header is not valid JSON ({err}); the file is corrupt: "
                                   f"{_fix(flag)}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{flag}: {path}: its header is not a JSON object; the file is corrupt: {_fix(flag)}")
    data_end = max((int(entry["data_offsets"][1]) for name, entry in header.items()
                    if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry), default=0)
    expected = 8 + header_bytes + data_end
    if size < expected:
        raise SafetensorsError(f"{flag}: {path} has {size} bytes, its header says {expected}; the file is "
                               f"truncated: {_fix(flag)}")


def check_safetensors_folder(folder: str | os.PathLike, *, flag: str) -> None:
    """`check_safetensors_file` on every `*.safetensors` file of `folder`, and every shard its index names exists."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as err:
            raise SafetensorsError(f"{flag}: {index} is not a readable index ({err}): {_fix(flag)}") from None
        missing = sorted({shard for shard in weight_map.values() if not (folder / shard).is_file()})
        if missing:
            raise SafetensorsError(f"{flag}: {folder}: the index names shards that are not there: "
                                   f"{', '.join(missing[:5])}: {_fix(flag)}")
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors_file(path, flag=flag)
