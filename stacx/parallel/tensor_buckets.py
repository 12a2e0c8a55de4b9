"""The one codec for tensors between processes: named tensors laid out in uint8 buckets.

Every transport that moves tensors uses it: the weight push to an inference server (HTTP body or
shared-memory file, `stacx.wire.weight_transfer`), the exchange syncs between two roles'
workers (`stacx.trainer.cluster.ray.exchange_endpoint`) and the values torchrun ranks share
(`stacx.trainer.cluster.rank_messages`). Each wraps the slots in its own header (JSON with a
version and a final flag; an HMAC'd store value; a rank message), but the layout, the closed
dtype table and the checks of a received slot are these.

Layout (`plan_buckets`): tensors in order, each starting at a multiple of `ALIGN_BYTES` (so it
can be viewed, not copied, out of its bucket, whatever its dtype); a new bucket starts when the
next tensor would end past `bucket_bytes` (a tensor larger than a bucket gets one of its own).
A `TensorSlot` says where one tensor's bytes are: (name, dtype, shape, bucket, offset, num_bytes).

Bytes travel, never values, so every dtype (bf16, fp8, int, bool, NaN payloads) arrives
bitwise-identical. A received slot is checked field by field (`check_slot`) before any byte is
viewed: the dtype comes from the closed table `TENSOR_DTYPES` (no pickle, no arbitrary type),
the shape is a list of non-negative ints, the byte count is numel * element size, the offset is a
multiple of the element size and the bytes lie inside the bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

ALIGN_BYTES = 64
"""Each tensor starts at a multiple of this, so it can be viewed (not copied) out of its bucket."""

TENSOR_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
}
"""The closed table of dtypes a bucket carries, by the name written in headers (torch's own names)."""
_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
SLOT_FIELDS = ("name", "dtype", "shape", "bucket", "offset", "num_bytes")

Tensors = Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
"""Named tensors, in order: a mapping or a list of (name, tensor) pairs (a weight bucket)."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes sit: bucket index, byte offset, byte count, and how to view them."""

    name: str
    dtype: str
    """A key of `TENSOR_DTYPES`."""
    shape: tuple[int, ...]
    bucket: int
    offset: int
    num_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "bucket": self.bucket,
                "offset": self.offset, "num_bytes": self.num_bytes}


def dtype_name(dtype: torch.dtype, tensor_name: str) -> str:
    """The header name of `dtype`; ValueError naming the tensor when no transport carries it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"tensor {tensor_name!r} has dtype {dtype}, which Stacx does not send between processes; "
                         f"supported: {', '.join(TENSOR_DTYPES)}")
    return name


def _pairs(tensors: Tensors) -> Iterable[tuple[str, torch.Tensor]]:
    return tensors.items() if isinstance(tensors, Mapping) else tensors


def plan_buckets(tensors: Tensors, bucket_bytes: int | None = None) -> tuple[list[TensorSlot], list[int]]:
    """Slots of every tensor (in order) and each bucket's size in bytes; one bucket when `bucket_bytes` is None."""
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"tensor buckets: bucket_bytes must be >= 1, got {bucket_bytes}")
    slots: list[TensorSlot] = []
    bucket_sizes: list[int] = []
    offset = 0
    for name, tensor in _pairs(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor buckets: value of {name!r} is a {type(tensor).__name__}, expected a tensor")
        num_bytes = tensor.numel() * tensor.element_size()
        start = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        if not bucket_sizes or (bucket_bytes is not None and start + num_bytes > bucket_bytes and offset > 0):
            bucket_sizes.append(0)
            start = 0
        slots.append(TensorSlot(name, dtype_name(tensor.dtype, name), tuple(tensor.shape), len(bucket_sizes) - 1,
                                start, num_bytes))
        offset = start + num_bytes
        bucket_sizes[-1] = offset
    return slots, bucket_sizes


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(tensors: Tensors, slots: Sequence[TensorSlot], bucket: int, size: int,
                device: torch.device | str = "cpu", out: torch.Tensor | None = None) -> torch.Tensor:
    """The uint8 buffer [size] of bucket `bucket`: each slot's raw bytes at its offset (into `out` if given)."""
    buffer = torch.zeros(size, dtype=torch.uint8, device=device) if out is None else out[:size]
    by_name = dict(_pairs(tensors))
    for slot in slots:
        if slot.bucket == bucket and slot.num_bytes:
            buffer[slot.offset : slot.offset + slot.num_bytes].copy_(raw_bytes(by_name[slot.name]))
    return buffer


def bucket_chunks(tensors: Tensors, slots: Sequence[TensorSlot], bucket: int = 0) -> list[memoryview]:
    """Bucket `bucket` as buffers to write back to back (zero padding between tensors, each tensor's
    own CPU memory in place): the receiver reads one buffer laid out like `pack_bucket`'s."""
    by_name = dict(_pairs(tensors))
    chunks: list[memoryview] = []
    end = 0
    for slot in slots:
        if slot.bucket != bucket:
            continue
        if slot.offset > end:
            chunks.append(memoryview(bytes(slot.offset - end)))
        chunks.append(memoryview(raw_bytes(by_name[slot.name].cpu()).numpy()))
        end = slot.offset + slot.num_bytes
    return chunks


def unpack_bucket(buffer: torch.Tensor, slots: Sequence[TensorSlot], bucket: int = 0) -> dict[str, torch.Tensor]:
    """Views of every tensor of bucket `bucket`, in slot order (sharing the buffer's memory)."""
    out = {}
    for slot in slots:
        if slot.bucket == bucket:
            raw = buffer[slot.offset : slot.offset + slot.num_bytes]
            out[slot.name] = raw.view(TENSOR_DTYPES[slot.dtype]).reshape(slot.shape)
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_slot(entry: Any, where: str, *, bucket_bytes: int | None = None,
               error: type[ValueError] = ValueError) -> TensorSlot:
    """The `TensorSlot` a received header entry (a dict of `SLOT_FIELDS`) describes, every field checked;
    `error` (naming `where` and the field) otherwise. With `bucket_bytes`, the bytes must lie inside it."""
    if not isinstance(entry, dict) or set(entry) != set(SLOT_FIELDS):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise error(f"{where}: expected the fields {list(SLOT_FIELDS)}, got {got}")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if not isinstance(name, str) or not name:
        raise error(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    where = f"{where} ({name!r})"
    if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
        raise error(f"{where}: field 'dtype' is {dtype!r}, not one of {', '.join(TENSOR_DTYPES)}")
    if not isinstance(shape, (list, tuple)) or not all(_is_count(d) for d in shape):
        raise error(f"{where}: field 'shape' must be a list of non-negative ints, got {shape!r}")
    for field in ("bucket", "offset", "num_bytes"):
        if not _is_count(entry[field]):
            raise error(f"{where}: field {field!r} must be a non-negative int, got {entry[field]!r}")
    element_size = TENSOR_DTYPES[dtype].itemsize
    expected = math.prod(shape) * element_size
    if entry["num_bytes"] != expected:
        raise error(f"{where}: field 'num_bytes' is {entry['num_bytes']}, but shape {list(shape)} of {dtype} "
                    f"holds {expected} bytes")
    if entry["offset"] % element_size:
        raise error(f"{where}: field 'offset' {entry['offset']} is not a multiple of the {dtype} element size "
                    f"{element_size}")
    if bucket_bytes is not None and entry["offset"] + entry["num_bytes"] > bucket_bytes:
        raise error(f"{where}: bytes [{entry['offset']}, {entry['offset'] + entry['num_bytes']}) are not inside "
                    f"the {bucket_bytes}-byte bucket")
    return TensorSlot(name, dtype, tuple(shape), entry["bucket"], entry["offset"], entry["num_bytes"])


HEADER_COLUMNS = ("names", "dtypes", "shapes", "offsets")
"""A bucket header's per-tensor lists (one entry per tensor; with `num_bytes`, `version`, `bucket` and `final`)."""


def check_bucket_header(header: Any, num_bytes_available: int, *, where: str, first_version: int = 0,
                        bucket_required: bool = False, error: type[ValueError] = ValueError) -> list[TensorSlot]:
    """The slots a received bucket header describes, checked as a whole against the `num_bytes_available` bytes
    that back it before any tensor is viewed: `names`, `dtypes`, `shapes`, `offsets` are lists of one length and
    each tensor's entry passes `check_slot`; `num_bytes` is an int no larger than the bytes available; `version` an
    int >= `first_version`; `bucket` a non-negative int (optional unless `bucket_required`: older senders omit it);
    `final` a bool. `error` (naming `where` and the field) otherwise: the receiver's refusal type (`stacx serve`'s
    weight endpoints and the vLLM worker extension both check headers here)."""
    if not isinstance(header, dict):
        raise error(f"{where}: the weight header must be a JSON object, got {type(header).__name__}")
    required = (*HEADER_COLUMNS, "num_bytes", "version", *(("bucket",) if bucket_required else ()), "final")
    missing = [key for key in required if key not in header]
    if missing:
        raise error(f"{where}: the header is missing field(s) {missing}")
    if not _is_count(header["version"]) or header["version"] < first_version:
        raise error(f"{where}: 'version' must be an integer >= {first_version}, got {header['version']!r}")
    if "bucket" in header and not _is_count(header["bucket"]):
        raise error(f"{where}: 'bucket' must be a non-negative integer, got {header['bucket']!r}")
    if not isinstance(header["final"], bool):
        raise error(f"{where}: 'final' must be true or false, got {header['final']!r}")
    num_bytes = header["num_bytes"]
    if not _is_count(num_bytes) or num_bytes > num_bytes_available:
        raise error(f"{where}: 'num_bytes' must be an integer in [0, {num_bytes_available}] (the bytes sent), "
                    f"got {num_bytes!r}")
    columns = {key: header[key] for key in HEADER_COLUMNS}
    for key, value in columns.items():
        if not isinstance(value, list):
            raise error(f"{where}: '{key}' must be a list, got {type(value).__name__}")
    lengths = {key: len(value) for key, value in columns.items()}
    if len(set(lengths.values())) != 1:
        raise error(f"{where}: 'names', 'dtypes', 'shapes' and 'offsets' must have one entry per tensor; "
                    f"got lengths {lengths}")
    slots = []
    for i, (name, dtype, shape, offset) in enumerate(zip(*columns.values())):
        sized = (isinstance(dtype, str) and dtype in TENSOR_DTYPES and isinstance(shape, list)
                 and all(_is_count(d) for d in shape))
        entry = {"name": name, "dtype": dtype, "shape": shape, "bucket": 0, "offset": offset,
                 "num_bytes": math.prod(shape) * TENSOR_DTYPES[dtype].itemsize if sized else 0}
        slots.append(check_slot(entry, f"{where}: tensor {i}", bucket_bytes=num_bytes, error=error))
    return slots
