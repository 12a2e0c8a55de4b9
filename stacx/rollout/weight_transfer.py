"""Weight buckets on the wire: many (hf_name, tensor) flattened into one contiguous buffer.

Sending one large buffer per bucket instead of one message per tensor is what makes weight
sync fast (per-tensor sends are ~10x slower at scale). The HTTP body of a bucket is

    [8-byte little-endian header length][JSON header][raw bytes of all tensors, back to back]

with header `{"names", "dtypes", "shapes", "offsets", "version", "final"}` (offsets in bytes).
The receiver views the raw bytes as tensors without copying and copies each into its parameter.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weight bucket: dtype {dtype} is not supported; supported: {sorted(_DTYPES)}")
    return name


@dataclass(frozen=True)
class FlatBucket:
    """A bucket flattened into one uint8 buffer `data` [num_bytes] plus per-tensor metadata."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    data: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> FlatBucket:
    """Concatenate every tensor's bytes (one copy) into a single CPU uint8 buffer."""
    if not bucket:
        raise ValueError("flatten_bucket: empty bucket")
    names, dtypes, shapes, offsets, pieces = [], [], [], [], []
    offset = 0
    for name, tensor in bucket:
        tensor = tensor.detach()
        names.append(name)
        dtypes.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
        offsets.append(offset)
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        pieces.append(raw)
        offset += raw.numel()
    data = torch.cat(pieces).cpu() if len(pieces) > 1 else pieces[0].cpu().clone()
    return FlatBucket(names, dtypes, shapes, offsets, data)


def bucket_wire_chunks(bucket: Sequence[tuple[str, torch.Tensor]], *, version: int, final: bool) -> list:
    """The HTTP body of a bucket as buffers to send back to back: the length-prefixed header, then
    each tensor's bytes in place (no concatenation copy; the receiver gets one flat buffer)."""
    if not bucket:
        raise ValueError("bucket_wire_chunks: empty bucket")
    names, dtypes, shapes, offsets, chunks = [], [], [], [], []
    offset = 0
    for name, tensor in bucket:
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        names.append(name)
        dtypes.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
        offsets.append(offset)
        chunks.append(memoryview(raw.numpy()))
        offset += raw.numel()
    header = json.dumps({
        "names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets,
        "num_bytes": offset, "version": int(version), "final": bool(final),
    }).encode()
    return [struct.pack("<Q", len(header)) + header, *chunks]


def unflatten_bucket(flat: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat.data`, one per tensor (no copy)."""
    out = []
    for name, dtype, shape, offset in zip(flat.names, flat.dtypes, flat.shapes, flat.offsets):
        torch_dtype = _DTYPES[dtype]
        numel = 1
        for dim in shape:
            numel *= dim
        num_bytes = numel * torch_dtype.itemsize
        out.append((name, flat.data[offset:offset + num_bytes].view(torch_dtype).view(shape)))
    return out


def encode_bucket_header(flat: FlatBucket, *, version: int, final: bool) -> bytes:
    """The length-prefixed JSON header; the raw bytes (`flat.data`) follow it in the body."""
    header = json.dumps({
        "names": flat.names, "dtypes": flat.dtypes, "shapes": flat.shapes, "offsets": flat.offsets,
        "num_bytes": flat.num_bytes, "version": int(version), "final": bool(final),
    }).encode()
    return struct.pack("<Q", len(header)) + header


def decode_bucket_body(body: bytearray | bytes | memoryview) -> tuple[FlatBucket, dict]:
    """Inverse of header + raw bytes; the tensors view `body` (keep it alive while they are used)."""
    view = memoryview(body)
    if len(view) < 8:
        raise ValueError("weight bucket body is shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", view[:8])
    try:
        header = json.loads(bytes(view[8:8 + header_len]))
    except json.JSONDecodeError as err:
        raise ValueError(f"weight bucket header is not JSON: {err}") from err
    raw = view[8 + header_len:]
    if len(raw) != header["num_bytes"]:
        raise ValueError(f"weight bucket: header says {header['num_bytes']} bytes, body holds {len(raw)}")
    data = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    flat = FlatBucket(header["names"], header["dtypes"], header["shapes"], header["offsets"], data)
    return flat, header


class SharedMemoryStaging:
    """A reusable same-host staging file (RAM-backed where the OS offers one) holding one bucket.

    The sender copies a bucket's tensors into it (one copy) and posts only the metadata; the
    server maps the same file and copies into its parameters (one copy). Nothing crosses a socket.
    """

    def __init__(self):
        import tempfile

        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, self.path = tempfile.mkstemp(prefix="stacx-weights-", dir=directory)
        os.close(handle)
        self.capacity = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def write(self, bucket: Sequence[tuple[str, torch.Tensor]], *, version: int, final: bool) -> dict:
        """Copy the bucket into the file; return the header the receiver needs (with `path`)."""
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        total = sum(sizes)
        if total > self.capacity:
            with open(self.path, "r+b") as handle:
                handle.truncate(total)
            self.buffer = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
            self.capacity = total
        header = {"path": self.path, "names": [], "dtypes": [], "shapes": [], "offsets": [], "num_bytes": total,
                  "version": int(version), "final": bool(final)}
        offset = 0
        for (name, tensor), size in zip(bucket, sizes):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self.buffer[offset:offset + size].copy_(raw)
            header["names"].append(name)
            header["dtypes"].append(dtype_name(tensor.dtype))
            header["shapes"].append(list(tensor.shape))
            header["offsets"].append(offset)
            offset += size
        return header

    def close(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if os.path.exists(self.path):
            os.unlink(self.path)


class SharedMemoryReader:
    """The receiving end: maps staging files (cached per path and size) as flat buckets."""

    def __init__(self):
        self._maps: dict[str, torch.Tensor] = {}

    def read(self, header: dict) -> FlatBucket:
        path, num_bytes = header["path"], int(header["num_bytes"])
        if not os.path.isfile(path):
            raise ValueError(f"shared-memory weight file {path} does not exist (sender on another host?)")
        mapped = self._maps.get(path)
        if mapped is None or mapped.numel() < num_bytes:
            mapped = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
            self._maps[path] = mapped
        return FlatBucket(header["names"], header["dtypes"], header["shapes"], header["offsets"], mapped[:num_bytes])
