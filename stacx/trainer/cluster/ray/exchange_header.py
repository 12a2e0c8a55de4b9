"""The authenticated, pickle-free header of one exchange transfer.

A source rank tells its target ranks what its buckets hold by writing one header to the
group's store. The store is a plain key-value server: any process that can reach its port can
read and write keys. So the header is

    value = mac (32 bytes) || body
    body  = UTF-8 JSON {"version": 1, "tensors": [{"name", "dtype", "shape", "bucket",
                                                    "offset", "num_bytes"}, ...]}
    mac   = HMAC-SHA256(secret, DOMAIN || 0x00 || key || 0x00 || body)

where `secret` is the group's per-run secret (32 random bytes drawn by the driver with
`secrets.token_bytes` and handed to each member in its `open_exchange` call, never written to
the store) and `key` is the store key the header is written under (group name, transfer id and
source rank), so a header cannot be replayed under another transfer, rank or group.

A reader checks the MAC (constant time) before it parses anything; then it parses JSON, never
pickle, and checks every field: the dtype comes from the closed table `EXCHANGE_DTYPES`, the
shape is a list of non-negative ints, and the byte count equals numel * element size. A header
that fails any check is refused with `ExchangeHeaderError` naming the key and the field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

HEADER_VERSION = 1
MAC_BYTES = hashlib.sha256().digest_size  # 32
MIN_SECRET_BYTES = 16
"""Shortest secret accepted; the driver draws 32 bytes."""
MAC_DOMAIN = b"stacx-exchange-header-v1"
"""Prefix of every MAC'd message, so these MACs cannot be confused with any other use of the secret."""

EXCHANGE_DTYPES: dict[str, torch.dtype] = {
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
"""The closed table of dtypes an exchange carries, by the name written in headers."""
_DTYPE_NAMES = {dtype: name for name, dtype in EXCHANGE_DTYPES.items()}
_SLOT_FIELDS = ("name", "dtype", "shape", "bucket", "offset", "num_bytes")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes sit: bucket index, byte offset, byte count, and how to view them."""

    name: str
    dtype: str
    """A key of `EXCHANGE_DTYPES`."""
    shape: tuple[int, ...]
    bucket: int
    offset: int
    num_bytes: int


class ExchangeHeaderError(ValueError):
    """A transfer header was refused: bad MAC (not written by a member of this run's group) or malformed."""


def dtype_name(dtype: torch.dtype, tensor_name: str) -> str:
    """The header name of `dtype`; ValueError naming the tensor when exchanges cannot carry it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"exchange: tensor {tensor_name!r} has dtype {dtype}, which exchanges do not carry; "
                         f"supported: {', '.join(EXCHANGE_DTYPES)}")
    return name


def check_secret(secret: Any, where: str) -> bytes:
    """`secret` as bytes; ValueError naming `where` unless it is bytes of at least MIN_SECRET_BYTES."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        described = f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
        raise ValueError(f"{where}: secret must be at least {MIN_SECRET_BYTES} random bytes (the driver draws them "
                         f"with secrets.token_bytes), got {described}")
    return bytes(secret)


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    message = MAC_DOMAIN + b"\x00" + key.encode("utf-8") + b"\x00" + body
    return hmac.new(secret, message, hashlib.sha256).digest()


def encode_header(secret: bytes, key: str, slots: list[TensorSlot]) -> bytes:
    """The store value announcing `slots` under `key` (see the module docstring for the layout)."""
    body = json.dumps({
        "version": HEADER_VERSION,
        "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "bucket": s.bucket,
                     "offset": s.offset, "num_bytes": s.num_bytes} for s in slots],
    }, separators=(",", ":")).encode("utf-8")
    return _mac(secret, key, body) + body


def decode_header(secret: bytes, key: str, value: bytes) -> list[TensorSlot]:
    """The slots announced under `key`; ExchangeHeaderError unless the MAC and every field check out."""
    if len(value) < MAC_BYTES or not hmac.compare_digest(value[:MAC_BYTES], _mac(secret, key, value[MAC_BYTES:])):
        raise ExchangeHeaderError(
            f"exchange: the header under store key {key!r} failed authentication (its HMAC does not match this "
            "run's exchange secret): it was not written by a member of this group, so it is refused unread. "
            "Another process can reach the exchange store's port; run on a private network (docs/security.md)"
        )
    try:
        header = json.loads(value[MAC_BYTES:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExchangeHeaderError(f"exchange: the header under store key {key!r} is not JSON: {err}") from None
    if not isinstance(header, dict) or header.get("version") != HEADER_VERSION or not isinstance(
            header.get("tensors"), list):
        raise ExchangeHeaderError(f"exchange: the header under store key {key!r} must be a JSON object with "
                                  f"\"version\": {HEADER_VERSION} and a \"tensors\" list (sender and receiver "
                                  "run different Stacx versions?)")
    return [_decode_slot(entry, key, index) for index, entry in enumerate(header["tensors"])]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _decode_slot(entry: Any, key: str, index: int) -> TensorSlot:
    where = f"exchange: the header under store key {key!r}, tensor {index}"
    if not isinstance(entry, dict) or set(entry) != set(_SLOT_FIELDS):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ExchangeHeaderError(f"{where}: expected the fields {list(_SLOT_FIELDS)}, got {got}")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if not isinstance(name, str):
        raise ExchangeHeaderError(f"{where}: field 'name' must be a string, got {name!r}")
    if dtype not in EXCHANGE_DTYPES:
        raise ExchangeHeaderError(f"{where} ({name!r}): field 'dtype' is {dtype!r}, not one of "
                                  f"{', '.join(EXCHANGE_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ExchangeHeaderError(f"{where} ({name!r}): field 'shape' must be a list of non-negative ints, "
                                  f"got {shape!r}")
    for field in ("bucket", "offset", "num_bytes"):
        if not _is_count(entry[field]):
            raise ExchangeHeaderError(f"{where} ({name!r}): field {field!r} must be a non-negative int, "
                                      f"got {entry[field]!r}")
    element_size = EXCHANGE_DTYPES[dtype].itemsize
    if entry["num_bytes"] != math.prod(shape) * element_size:
        raise ExchangeHeaderError(f"{where} ({name!r}): field 'num_bytes' is {entry['num_bytes']}, but shape "
                                  f"{shape} of {dtype} holds {math.prod(shape) * element_size} bytes")
    if entry["offset"] % element_size:
        raise ExchangeHeaderError(f"{where} ({name!r}): field 'offset' {entry['offset']} is not a multiple of "
                                  f"the {dtype} element size {element_size}")
    return TensorSlot(name, dtype, tuple(shape), entry["bucket"], entry["offset"], entry["num_bytes"])
