"""Weight buckets on the wire: many (hf_name, tensor) flattened into one contiguous buffer.

Sending one large buffer per bucket instead of one message per tensor is what makes weight
sync fast (per-tensor sends are ~10x slower at scale). The HTTP body of a bucket is

    [8-byte little-endian header length][JSON header][raw bytes of all tensors, back to back]

with header `{"names", "dtypes", "shapes", "offsets", "num_bytes", "version", "bucket", "final", "sender"}`
(offsets in bytes; `bucket` numbers the update's buckets from 0, so that a server can refuse a
replayed one, and `sender` is the sending client's random id, so that a client's retry is told from
another sender's bucket; see stacx.wire.weight_versions). The layout, the dtype table and the per-tensor checks are the one codec of
`stacx.parallel.tensor_buckets` (also used by exchange syncs and torchrun rank messages): each
tensor starts at a 64-byte aligned offset. The receiver views the raw bytes as tensors without
copying and copies each into its parameter.

A header is checked as a whole (`validate_bucket_header`) before any tensor is viewed, so a
malformed bucket is rejected (a ValueError naming the field, HTTP 400) before it can touch a
parameter. Same-host updates go through shared-memory files that the *server* creates and names
(`SharedMemoryRegistry`); a request names a file only by the opaque id the server handed out,
never by a path.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

import torch

from stacx.parallel.tensor_buckets import (
    ALIGN_BYTES,
    TensorSlot,
    bucket_chunks,
    check_bucket_header,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)

logger = logging.getLogger(__name__)

BUCKET_ENDPOINT = "/stacx/update_weights_bucket"
"""`stacx serve`'s endpoint for one bucket in the HTTP body."""
SHM_BUCKET_ENDPOINT = "/stacx/update_weights_from_shm"
"""... for one bucket written into a shared-memory staging file (the body names the file's id)."""
SHM_STAGING_ENDPOINT = "/stacx/shm_staging"
"""... that creates a staging file and hands back its id and path."""
SHM_RELEASE_ENDPOINT = "/stacx/shm_staging/release"
"""... that removes a staging file."""
DIGEST_ENDPOINT = "/stacx/weight_digests"
"""... that answers a digest of every tensor the engine holds (the post-sync check)."""

@dataclass(frozen=True)
class FlatBucket:
    """A received bucket: its slots (`stacx.parallel.tensor_buckets`) and the uint8 buffer `data` [num_bytes] they index."""

    slots: list[TensorSlot]
    data: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


def header_columns(slots: Sequence[TensorSlot]) -> dict[str, list]:
    """The bucket header's per-tensor columns (the same names SGLang's weight endpoints use)."""
    return {"names": [s.name for s in slots], "dtypes": [s.dtype for s in slots],
            "shapes": [list(s.shape) for s in slots], "offsets": [s.offset for s in slots]}


def bucket_wire_chunks(bucket: Sequence[tuple[str, torch.Tensor]], *, version: int, final: bool,
                       index: int = 0, sender: Optional[str] = None) -> list:
    """The HTTP body of bucket number `index` of an update as buffers to send back to back: the
    length-prefixed header, then each tensor's bytes in place (no concatenation copy; the receiver
    gets one flat buffer)."""
    if not bucket:
        raise ValueError("bucket_wire_chunks: empty bucket")
    slots, (num_bytes,) = plan_buckets(bucket)
    header = json.dumps({**header_columns(slots), "num_bytes": num_bytes, "version": int(version),
                         "bucket": int(index), "final": bool(final), **_sender_field(sender)}).encode()
    return [struct.pack("<Q", len(header)) + header, *bucket_chunks(bucket, slots)]


def _sender_field(sender: Optional[str]) -> dict:
    return {} if sender is None else {"sender": str(sender)}


MAX_SENDER_CHARS = 64
"""The longest `sender` id a bucket header may carry."""

HEADER_BYTES_PER_TENSOR = 1024
"""Room for one tensor's header entry (name, dtype, shape, offset; ~150 bytes for real names)."""


def numbered_buckets(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]
                     ) -> Iterator[tuple[int, Sequence[tuple[str, torch.Tensor]], bool]]:
    """(index, bucket, final) of an update's buckets, numbered 0, 1, ... with only the last one final: each
    bucket is handed on once the next one is known (the buckets may be produced lazily). ValueError when
    there are none."""
    pending, index = None, -1
    for bucket in buckets:
        if pending is not None:
            yield index, pending, False
        pending, index = bucket, index + 1
    if pending is None:
        raise ValueError("update_weights: no buckets given")
    yield index, pending, True


def max_bucket_body_bytes(num_tensor_bytes: int, num_tensors: int) -> int:
    """The largest body a bucket of at most `num_tensors` tensors and `num_tensor_bytes` tensor
    bytes can need: the 8-byte length, the header (4 KiB + HEADER_BYTES_PER_TENSOR per tensor) and
    the tensors, each at an ALIGN_BYTES-aligned offset."""
    return 8 + 4096 + num_tensors * (HEADER_BYTES_PER_TENSOR + ALIGN_BYTES) + num_tensor_bytes


def validate_bucket_header(header, num_bytes_available: int, *, where: str) -> FlatBucket:
    """Check a whole bucket header against the `num_bytes_available` bytes that back it, before any tensor is
    viewed (`tensor_buckets.check_bucket_header`: `version` an int >= 0, `bucket` optional, older senders omit
    it), and its optional `sender` (a string of 1 to MAX_SENDER_CHARS characters). Raises ValueError naming the
    field (`where` names the endpoint). Returns the slots with an empty `data` placeholder."""
    slots = check_bucket_header(header, num_bytes_available, where=where)
    if "sender" in header and (not isinstance(header["sender"], str) or not 0 < len(header["sender"]) <= MAX_SENDER_CHARS):
        raise ValueError(f"{where}: 'sender' must be a string of 1 to {MAX_SENDER_CHARS} characters, "
                         f"got {header['sender']!r}")
    return FlatBucket(slots, torch.empty(0, dtype=torch.uint8))


def unflatten_bucket(flat: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat.data`, one per tensor (no copy); the header must have been validated."""
    return list(unpack_bucket(flat.data, flat.slots).items())


def refuse_non_finite(named_tensors: Sequence[tuple[str, torch.Tensor]], *, where: str) -> None:
    """Raise ValueError naming the first tensor that holds NaN or infinity (a diverged sender:
    loaded, it would make the server generate padding)."""
    for name, tensor in named_tensors:
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            num_bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{where}: tensor {name!r} holds {num_bad} NaN or infinite values; the bucket was "
                             "not loaded (the sender's weights diverged)")


def decode_bucket_body(body: bytearray | bytes | memoryview, *, where: str = "weight bucket") -> tuple[FlatBucket, dict]:
    """Inverse of header + raw bytes, the whole header validated first; the tensors view `body`
    (keep it alive while they are used)."""
    view = memoryview(body)
    if len(view) < 8:
        raise ValueError(f"{where}: body is shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > len(view) - 8:
        raise ValueError(f"{where}: header length {header_len} exceeds the {len(view) - 8} bytes that follow it")
    try:
        header = json.loads(bytes(view[8:8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: header is not JSON: {err}") from err
    raw = view[8 + header_len:]
    flat = validate_bucket_header(header, len(raw), where=where)
    if header["num_bytes"] != len(raw):
        raise ValueError(f"{where}: header says num_bytes {header['num_bytes']}, body holds {len(raw)}")
    data = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return FlatBucket(flat.slots, data), header


def shared_memory_directory() -> str:
    """Where staging files live: RAM-backed /dev/shm where the OS has one, else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


SHM_FILE_PREFIX = "stacx-weights-"


class MappedStagingFile:
    """A same-host staging file seen as one byte tensor (`buffer`) that grows to the largest bucket packed
    into it. A subclass sets `path`, `capacity` (0) and an empty `buffer` when it opens the file."""

    path: str
    capacity: int
    buffer: torch.Tensor

    def _resize_file(self, num_bytes: int) -> None:
        os.truncate(self.path, num_bytes)

    def pack(self, bucket: Sequence[tuple[str, torch.Tensor]], slots: Sequence[TensorSlot], num_bytes: int) -> None:
        """Copy the bucket's tensors, laid out by `slots` (`num_bytes` in all), into the file, first growing
        it (and its mapping) when the bucket is larger than any before."""
        if num_bytes > self.capacity:
            self._resize_file(num_bytes)
            self.buffer = torch.from_file(self.path, shared=True, size=num_bytes, dtype=torch.uint8)
            self.capacity = num_bytes
        if num_bytes:
            pack_bucket(bucket, slots, 0, num_bytes, out=self.buffer)


class SharedMemoryStaging(MappedStagingFile):
    """The sender's end of a same-host staging file that the server created (see
    `SharedMemoryRegistry`): the sender copies a bucket's tensors into it (one copy) and posts only
    the metadata and the server's `staging_id`; the server maps the same file and copies into its
    parameters (one copy). Nothing crosses a socket.

    `close()` unmaps and removes the file; it is safe to call twice (the server may have removed
    the file already).
    """

    def __init__(self, path: str, staging_id: str):
        self.path, self.staging_id = path, staging_id
        # open it once, never following a link planted at that name
        self._fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        self.capacity = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def write(self, bucket: Sequence[tuple[str, torch.Tensor]], *, version: int, final: bool, index: int = 0,
              sender: Optional[str] = None) -> dict:
        """Copy bucket number `index` of an update into the file; return the header the receiver
        needs (with `staging_id`)."""
        if self._fd is None:
            raise RuntimeError(f"shared-memory staging {self.path} is closed")
        slots, sizes = plan_buckets(bucket)
        total = sizes[0] if sizes else 0
        self.pack(bucket, slots, total)
        header = {"staging_id": self.staging_id, **header_columns(slots), "num_bytes": total,
                  "version": int(version), "bucket": int(index), "final": bool(final), **_sender_field(sender)}
        return header

    def _resize_file(self, num_bytes: int) -> None:
        os.ftruncate(self._fd, num_bytes)  # the descriptor opened without following links

    def close(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _remove_quietly(self.path)


@dataclass
class _StagingFile:
    path: str
    device: int
    inode: int
    mapped: torch.Tensor


class SharedMemoryRegistry:
    """The receiving end: staging files this server created, under its own random name prefix.

    `create()` (the handshake) makes a new empty file, mode 0600, named
    `<shm dir>/stacx-weights-<server prefix>-<random>` and returns `(staging_id, path)`; `read(header)`
    maps only the file registered under `header["staging_id"]`, after checking that the name still
    is the regular file it created (same device and inode, not a link). A request that names a
    `path` is refused: the server never opens a file a client named. `release(id)` and `close()`
    remove the files (close is safe to call twice).
    """

    MAX_FILES = 64
    """Most staging files one server keeps (one per connected sender is the normal case)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or shared_memory_directory()
        self.prefix = SHM_FILE_PREFIX + secrets.token_hex(6) + "-"
        self._files: dict[str, _StagingFile] = {}
        self._lock = threading.Lock()

    def create(self) -> tuple[str, str]:
        with self._lock:
            if len(self._files) >= self.MAX_FILES:
                raise ValueError(f"/stacx/shm_staging: this server already holds {self.MAX_FILES} staging files; "
                                 "release one (client shutdown) or use weight_transport='http'")
            handle, path = tempfile.mkstemp(prefix=self.prefix, dir=self.directory)  # O_EXCL, mode 0600
            try:
                info = os.fstat(handle)
            finally:
                os.close(handle)
            staging_id = secrets.token_urlsafe(16)
            self._files[staging_id] = _StagingFile(path, info.st_dev, info.st_ino, torch.empty(0, dtype=torch.uint8))
            return staging_id, path

    def read(self, header: dict, *, where: str) -> FlatBucket:
        """The bucket staged under `header["staging_id"]`, its header validated as a whole."""
        if not isinstance(header, dict):
            raise ValueError(f"{where}: the weight header must be a JSON object")
        if "path" in header:
            raise ValueError(f"{where}: 'path' is not accepted; ask POST /stacx/shm_staging for a staging file "
                             "and send its 'staging_id'")
        staging_id = header.get("staging_id")
        with self._lock:
            entry = self._files.get(staging_id) if isinstance(staging_id, str) else None
        if entry is None:
            raise ValueError(f"{where}: 'staging_id' {str(staging_id)[:40]!r} is not a staging file of this server; "
                             "ask POST /stacx/shm_staging for one")
        try:
            info = os.lstat(entry.path)
        except FileNotFoundError as err:
            raise ValueError(f"{where}: staging file {entry.path} was removed; ask for a new one") from err
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (entry.device, entry.inode):
            raise ValueError(f"{where}: staging file {entry.path} was replaced; refusing to read it")
        flat = validate_bucket_header(header, info.st_size, where=where)
        num_bytes = header["num_bytes"]
        if entry.mapped.numel() < num_bytes:
            entry.mapped = torch.from_file(entry.path, shared=True, size=info.st_size, dtype=torch.uint8)
        return FlatBucket(flat.slots, entry.mapped[:num_bytes])

    def release(self, staging_id) -> bool:
        with self._lock:
            entry = self._files.pop(staging_id, None) if isinstance(staging_id, str) else None
        if entry is not None:
            _remove_quietly(entry.path)
        return entry is not None

    @property
    def paths(self) -> list[str]:
        with self._lock:
            return [entry.path for entry in self._files.values()]

    def close(self) -> None:
        with self._lock:
            entries, self._files = list(self._files.values()), {}
        for entry in entries:
            _remove_quietly(entry.path)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # teardown goes on; the file is named so it can be removed by hand
        logger.warning("could not remove shared-memory weight file %s: %s", path, err)
