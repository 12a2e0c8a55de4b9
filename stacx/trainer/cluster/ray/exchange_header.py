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
pickle, and checks every slot with the one tensor codec's `check_slot`
(`stacx.parallel.tensor_buckets`: the dtype from its closed table, the shape a list of
non-negative ints, the byte count numel * element size). A header that fails any check is
refused with `ExchangeHeaderError` naming the key and the field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from stacx.parallel.tensor_buckets import TensorSlot, check_slot

HEADER_VERSION = 1
MAC_BYTES = hashlib.sha256().digest_size  # 32
MIN_SECRET_BYTES = 16
"""Shortest secret accepted; the driver draws 32 bytes."""
MAC_DOMAIN = b"stacx-exchange-header-v1"
"""Prefix of every MAC'd message, so these MACs cannot be confused with any other use of the secret."""


class ExchangeHeaderError(ValueError):
    """A transfer header was refused: bad MAC (not written by a member of this run's group) or malformed."""


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
        "tensors": [slot.to_dict() for slot in slots],
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
    return [check_slot(entry, f"exchange: the header under store key {key!r}, tensor {index}", error=ExchangeHeaderError)
            for index, entry in enumerate(header["tensors"])]
