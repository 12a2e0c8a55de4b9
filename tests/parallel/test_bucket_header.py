"""One bucket-header check (`tensor_buckets.check_bucket_header`) for both receivers of weight buckets: `stacx serve`'s
weight endpoints (versions from 0, the bucket number optional) and the vLLM worker extension (versions from 1, the
bucket number required, its own refusal type). Every field is checked before any byte is viewed, and a malformed
entry is refused naming the field, never with a TypeError."""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.tensor_buckets import check_bucket_header, plan_buckets
from stacx.wire.weight_transfer import validate_bucket_header


class Refused(ValueError):
    pass


def _header(**overrides) -> dict:
    slots, (num_bytes,) = plan_buckets([("w", torch.ones(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    header = {"names": [s.name for s in slots], "dtypes": [s.dtype for s in slots],
              "shapes": [list(s.shape) for s in slots], "offsets": [s.offset for s in slots],
              "num_bytes": num_bytes, "version": 1, "bucket": 0, "final": True}
    return {**header, **overrides}


def test_both_receivers_read_the_same_slots_from_a_header():
    header = _header()
    slots = check_bucket_header(header, header["num_bytes"], where="w", first_version=1, bucket_required=True)
    assert [(s.name, s.dtype, s.shape) for s in slots] == [("w", "float32", (3,)), ("b", "bfloat16", (2,))]
    assert validate_bucket_header(header, header["num_bytes"], where="w").slots == slots


@pytest.mark.parametrize("overrides, message", [
    ({"version": 0}, r"'version' must be an integer >= 1, got 0"),
    ({"version": True}, r"'version' must be an integer >= 1, got True"),
    ({"bucket": -1}, r"'bucket' must be a non-negative integer, got -1"),
    ({"final": 1}, r"'final' must be true or false, got 1"),
    ({"num_bytes": 10**9}, r"'num_bytes' must be an integer in \[0, "),
    ({"shapes": [[3]]}, r"one entry per tensor; got lengths"),
    ({"dtypes": [["float32"], "bfloat16"]}, r"tensor 0 \('w'\): field 'dtype' is \['float32'\], not one of"),
    ({"shapes": ["3", [2]]}, r"tensor 0 \('w'\): field 'shape' must be a list of non-negative ints"),
])
def test_a_malformed_header_is_refused_naming_the_field_with_the_receivers_error(overrides, message):
    header = _header(**overrides)
    with pytest.raises(Refused, match=f"^stacx_load_bucket: .*{message}"):
        check_bucket_header(header, _header()["num_bytes"], where="stacx_load_bucket", first_version=1,
                            bucket_required=True, error=Refused)


def test_the_servers_rules_take_version_0_and_no_bucket_number_and_the_workers_do_not():
    header = {k: v for k, v in _header(version=0).items() if k != "bucket"}
    assert len(check_bucket_header(header, header["num_bytes"], where="serve")) == 2
    with pytest.raises(ValueError, match=r"missing field\(s\) \['bucket'\]"):
        check_bucket_header(header, header["num_bytes"], where="worker", first_version=1, bucket_required=True)
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        validate_bucket_header([header], header["num_bytes"], where="serve")
