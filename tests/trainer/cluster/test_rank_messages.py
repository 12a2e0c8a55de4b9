"""Pickle-free messages between torchrun ranks: what round-trips, and what a forged message cannot do."""

from __future__ import annotations

import json
import math
import os
import pathlib
import pickle

import pytest
import torch

from stacx.testing.distributed import run_distributed
from stacx.trainer.checkpoint import FileInfo, RankCoords, RankFileInfo
from stacx.trainer.cluster.rank_messages import (
    LENGTH_BYTES,
    RankMessageError,
    decode_message,
    encode_message,
)


class PlantedPayload:
    """Unpickling this runs `touch <marker>`: the classic pickle attack."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _step_value():
    """Shaped like what the loop shares and gathers: a step batch, metrics, a rank file record."""
    generator = torch.Generator().manual_seed(0)
    batch = {
        "tokens": [torch.randint(0, 100, (7,), generator=generator), torch.randint(0, 100, (3,), generator=generator)],
        "rewards": [1.0, float("nan")],
        "group_indices": [0, 0],
        "teacher_top_ids": [[[1, 2], [3, 4]], None],
        "bf16": torch.tensor([0x7FC1, -0x8000], dtype=torch.int16).view(torch.bfloat16),  # NaN payload, -0.0
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(3, 4, generator=generator).t(),
        "mask": torch.tensor([True, False]),
    }
    metrics = {"policy/loss": 0.5, "time/step_s": float("inf"), 3: "int key", (1, "a"): -0.0}
    record = RankFileInfo(role="policy", rank=1, coords=RankCoords(tp_rank=0, cp_rank=0, dp_rank=1),
                          file=FileInfo(path="policy/rank_1.pt", size=10, sha256="ab"))
    return (batch, metrics), record, pathlib.Path("/tmp/staging"), ("kind", ("http://a",), None), None


def _assert_same(received, sent):
    if isinstance(sent, torch.Tensor):
        assert isinstance(received, torch.Tensor) and received.dtype == sent.dtype and received.shape == sent.shape
        assert torch.equal(received.contiguous().view(torch.uint8), sent.contiguous().view(torch.uint8))  # bitwise
    elif isinstance(sent, dict):
        assert type(received) is dict and list(received) == list(sent)
        for key in sent:
            _assert_same(received[key], sent[key])
    elif isinstance(sent, (list, tuple)):
        assert type(received) is type(sent) and len(received) == len(sent)
        for r, s in zip(received, sent):
            _assert_same(r, s)
    elif isinstance(sent, float) and math.isnan(sent):
        assert isinstance(received, float) and math.isnan(received)
    else:
        assert type(received) is type(sent) and received == sent
        if isinstance(sent, float):
            assert math.copysign(1.0, received) == math.copysign(1.0, sent)


def test_step_values_round_trip_bitwise_with_their_types():
    value = _step_value()
    _assert_same(decode_message(encode_message(value)), value)


def test_what_has_no_encoding_is_named_with_its_place():
    with pytest.raises(TypeError, match=r"value\[1\]\['obj'\] is a builtins.object.*MESSAGE_RECORDS"):
        encode_message([1, {"obj": object()}])
    with pytest.raises(TypeError, match="PlantedPayload"):
        encode_message(PlantedPayload("/nonexistent"))


def _message(header: dict, data: bytes = b"") -> torch.Tensor:
    body = json.dumps(header).encode()
    raw = len(body).to_bytes(LENGTH_BYTES, "little") + body + data
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def test_a_pickle_sent_as_a_message_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps([PlantedPayload(str(marker))])
    # Raw pickle bytes, then pickle bytes behind a valid length field.
    for raw in (payload, len(payload).to_bytes(LENGTH_BYTES, "little") + payload):
        with pytest.raises(RankMessageError):
            decode_message(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    assert not marker.exists()


@pytest.mark.parametrize("header, data, error", [
    ({"version": 1, "value": {"object": "os.system"}, "tensors": []}, b"", "expected a plain value or an object tagged"),
    ({"version": 1, "value": {"record": "Popen", "fields": {}}, "tensors": []}, b"", "record 'Popen' is not one of"),
    ({"version": 1, "value": {"record": "RankCoords", "fields": {"tp_rank": 0}}, "tensors": []}, b"",
     r"fields of RankCoords must be \['cp_rank', 'dp_rank', 'pp_rank', 'tp_rank'\]"),
    ({"version": 1, "value": {"tensor": 0}, "tensors": []}, b"", "names tensor 0; the message has 0"),
    ({"version": 1, "value": {"tensor": 0},
      "tensors": [{"dtype": "object", "shape": [1], "offset": 0, "num_bytes": 8}]}, b"\0" * 8, "field 'dtype' is 'object'"),
    ({"version": 1, "value": {"tensor": 0},
      "tensors": [{"dtype": "float32", "shape": [4], "offset": 0, "num_bytes": 16}]}, b"\0" * 8,
     "not inside the 8-byte bucket"),
    ({"version": 1, "value": {"tensor": 0},
      "tensors": [{"dtype": "float32", "shape": [3], "offset": 0, "num_bytes": 8}]}, b"\0" * 8, "holds 12 bytes"),
    ({"version": 2, "value": None, "tensors": []}, b"", "version 2"),
    ({"version": 1, "value": {"dict": [[[1], 2]]}, "tensors": []}, b"", "not a plain key"),
])
def test_a_malformed_message_names_the_field(header, data, error):
    with pytest.raises(RankMessageError, match=error):
        decode_message(_message(header, data))


def test_a_header_longer_than_the_message_is_refused():
    raw = (10**9).to_bytes(LENGTH_BYTES, "little") + b"{}"
    with pytest.raises(RankMessageError, match="header length 1000000000 exceeds the 2 bytes"):
        decode_message(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


# ---- over two gloo ranks ------------------------------------------------------------------------

def _exchange_without_pickle(groups):
    """Broadcast rank 0's step value and all-gather per-rank values with every unpickler disabled."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from stacx.trainer.cluster.rank_messages import all_gather_values, broadcast_value

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    c10d._unpickler, pickle.loads, pickle.Unpickler = refuse, refuse, refuse
    rank = dist.get_rank()
    shared = broadcast_value(_step_value() if rank == 0 else None, src=0)
    gathered = all_gather_values({"rank": rank, "values": torch.arange(rank + 1) * 1.5, "tail": "x" * (50 * rank)})
    _assert_same(shared, _step_value())
    return [(g["rank"], g["values"].tolist(), len(g["tail"])) for g in gathered]


def test_two_ranks_exchange_values_with_every_unpickler_disabled():
    results = run_distributed(_exchange_without_pickle, 2, timeout_s=120)
    expected = [(0, [0.0], 0), (1, [0.0, 1.5], 50)]
    assert results == [expected, expected]
