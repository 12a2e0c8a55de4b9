"""The one tensor codec: layout, bitwise round trips, slot checks, and every transport on it."""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.tensor_buckets import (
    ALIGN_BYTES,
    TENSOR_DTYPES,
    TensorSlot,
    bucket_chunks,
    check_slot,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)


def _roundtrip(tensors, bucket_bytes):
    slots, sizes = plan_buckets(tensors, bucket_bytes)
    out = {}
    for bucket, size in enumerate(sizes):
        out.update(unpack_bucket(pack_bucket(tensors, slots, bucket, size, torch.device("cpu")), slots, bucket))
    return slots, sizes, {slot.name: out[slot.name] for slot in slots}


def test_buckets_respect_the_size_cap_alignment_and_keep_bits():
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(10, generator=generator).to(torch.bfloat16),   # 20 bytes
        "b": torch.randn(30, generator=generator, dtype=torch.float64),  # 240 bytes
        "c": torch.tensor([True, False, True]),
        "d": torch.randn(200, generator=generator),                      # 800 bytes > the cap
        "e": torch.tensor([float("nan"), -0.0]),
    }
    slots, sizes, out = _roundtrip(tensors, bucket_bytes=300)
    assert all(slot.offset % ALIGN_BYTES == 0 for slot in slots)
    # a (0..20) and b (64..304) cannot share a 300-byte bucket; c fits after b (256..259);
    # d is larger than a bucket and gets one of its own; e cannot follow it.
    assert [slot.bucket for slot in slots] == [0, 1, 1, 2, 3]
    assert [slot.offset for slot in slots] == [0, 0, 256, 0, 0]
    assert sizes[2] == 800 and all(size <= 300 for i, size in enumerate(sizes) if i != 2)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_plan_buckets_rejects_non_tensors_and_bad_sizes():
    with pytest.raises(TypeError, match="'w'"):
        plan_buckets({"w": [1.0]}, 1024)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets({"w": torch.ones(1)}, 0)


def test_every_table_dtype_round_trips_bitwise_in_place_chunks_and_packed_buffers():
    tensors = [(name, torch.arange(6).to(dtype) if dtype != torch.bool else torch.tensor([True, False] * 3))
               for name, dtype in TENSOR_DTYPES.items() if not dtype.is_complex]
    slots, (size,) = plan_buckets(tensors)
    packed = pack_bucket(tensors, slots, 0, size)
    sent = b"".join(bytes(chunk) for chunk in bucket_chunks(tensors, slots))
    assert sent == bytes(packed.numpy()), "chunks written back to back must equal the packed buffer"
    out = unpack_bucket(torch.frombuffer(bytearray(sent), dtype=torch.uint8), slots)
    for name, tensor in tensors:
        assert torch.equal(out[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_received_slot_is_checked_field_by_field():
    good = TensorSlot("w", "float32", (2,), 0, 0, 8)
    assert check_slot(good.to_dict(), "probe", bucket_bytes=8) == good
    for overrides, error in [({"dtype": "object"}, r"'w'.*field 'dtype' is 'object', not one of bool"),
                             ({"num_bytes": 9}, r"field 'num_bytes' is 9, but shape \[2\] of float32 holds 8"),
                             ({"offset": 2}, r"field 'offset' 2 is not a multiple of the float32 element size"),
                             ({"offset": 4}, r"bytes \[4, 12\) are not inside the 8-byte bucket"),
                             ({"shape": [-2]}, r"field 'shape' must be a list of non-negative ints")]:
        with pytest.raises(ValueError, match=error):
            check_slot({**good.to_dict(), **overrides}, "probe", bucket_bytes=8)
    with pytest.raises(LookupError, match="probe: expected the fields"):
        check_slot({"name": "w"}, "probe", error=type("Refused", (LookupError, ValueError), {}))


def test_the_http_push_exchange_headers_and_rank_messages_share_the_layout():
    """The three transports lay tensors out the same way: the HTTP body, an exchange bucket, a rank message."""
    import json
    import secrets
    import struct

    from stacx.trainer.cluster.rank_messages import LENGTH_BYTES, decode_message, encode_message
    from stacx.trainer.cluster.ray.exchange_header import decode_header, encode_header
    from stacx.wire.weight_transfer import bucket_wire_chunks, decode_bucket_body

    tensors = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.arange(5, dtype=torch.float32))]
    slots, (size,) = plan_buckets(tensors)
    assert [s.offset for s in slots] == [0, ALIGN_BYTES]
    body = b"".join(bytes(chunk) for chunk in bucket_wire_chunks(tensors, version=1, final=True))
    flat, header = decode_bucket_body(bytearray(body))
    assert flat.slots == slots and header["offsets"] == [0, ALIGN_BYTES]
    assert bytes(flat.data.numpy()) == bytes(pack_bucket(tensors, slots, 0, size).numpy())
    secret = secrets.token_bytes(32)
    assert decode_header(secret, "k", encode_header(secret, "k", slots)) == slots
    message = encode_message([t for _, t in tensors])
    (header_length,) = struct.unpack("<Q", bytes(message[:LENGTH_BYTES].numpy()))
    entries = json.loads(bytes(message[LENGTH_BYTES:LENGTH_BYTES + header_length].numpy()))["tensors"]
    assert [e["offset"] for e in entries] == [s.offset for s in slots]
    assert all(torch.equal(x, y) for x, y in zip(decode_message(message), (t for _, t in tensors)))
