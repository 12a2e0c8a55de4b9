"""The exchange group's store and headers under attack: where it listens, what it refuses, what it never runs.

Two `ExchangeEndpoint`s (source rank 0 hosting the store, target rank 1) run in threads of this
process over a real `TCPStore` and gloo; an attacker is a third store client that knows the
address but not the group's secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from stacx.testing.listening_sockets import listening_addresses
from stacx.trainer.cluster.ray.exchange_endpoint import STORE_PREFIX, ExchangeEndpoint, host_store
from stacx.parallel.tensor_buckets import TENSOR_DTYPES, TensorSlot, plan_buckets
from stacx.trainer.cluster.ray.exchange_header import MAC_DOMAIN, ExchangeHeaderError, check_secret, decode_header, encode_header

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 20.0


class PlantedPayload:
    """Unpickling this runs `touch <marker>`: the classic pickle attack."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _open_pair(name: str, source_secret: bytes, target_secret: bytes, timeout_s: float = TIMEOUT_S):
    """(source endpoint hosting the store, target endpoint, the store's port), rendezvoused in threads."""
    store, port = host_store(LOOPBACK, timeout_s)
    endpoints: list = [None, None]
    errors: list = []

    def open_rank(rank: int, secret: bytes) -> None:
        try:
            endpoints[rank] = ExchangeEndpoint(name, rank, 2, LOOPBACK, port, secret=secret, local_host=LOOPBACK,
                                               backend="gloo", timeout_s=timeout_s,
                                               hosted_store=store if rank == 0 else None)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=open_rank, args=(rank, secret))
               for rank, secret in ((0, source_secret), (1, target_secret))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 10)
    assert not errors, errors
    return endpoints[0], endpoints[1], port


def _attacker(port: int, name: str) -> dist.PrefixStore:
    """A store client that knows the address and the key layout, not the secret."""
    client = dist.TCPStore(LOOPBACK, port, None, False, timedelta(seconds=TIMEOUT_S))
    return dist.PrefixStore(f"{STORE_PREFIX}/{name}", client)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
            "nan": torch.tensor([float("nan"), -0.0], dtype=torch.float64),
            "mask": torch.tensor([True, False])}


def _send_in_thread(endpoint: ExchangeEndpoint, transfer_id: int, tensors) -> threading.Thread:
    thread = threading.Thread(target=endpoint.send, args=(transfer_id, tensors, [1], 1024))
    thread.start()
    return thread


@pytest.fixture()
def pair():
    secret = secrets.token_bytes(32)
    source, target, port = _open_pair("policy_to_reference", secret, secret)
    yield source, target, port
    target.close()
    source.close()


def test_the_store_listens_on_the_given_address_only():
    store, port = host_store(LOOPBACK, TIMEOUT_S)
    addresses = listening_addresses(port=port)
    assert addresses == {LOOPBACK}, addresses  # never 0.0.0.0 / ::
    with pytest.raises(ValueError, match="node's cluster address.*'0.0.0.0'"):
        host_store("0.0.0.0", TIMEOUT_S)
    del store


def test_members_with_the_secret_move_tensors_bitwise(pair):
    source, target, _ = pair
    tensors = _tensors()
    sender = _send_in_thread(source, 0, tensors)
    received = target.receive(0, 0)
    sender.join(timeout=TIMEOUT_S)
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_a_header_forged_without_the_secret_is_refused(pair):
    source, target, port = pair
    attacker = _attacker(port, "policy_to_reference")
    forged = [TensorSlot("w", "float32", (2,), 0, 0, 8)]
    attacker.set(ExchangeEndpoint.header_key(0, 0), encode_header(secrets.token_bytes(32), "guess", forged))
    with pytest.raises(ExchangeHeaderError, match=r"'stacx-exchange/policy_to_reference/0/meta/0' failed "
                                                  r"authentication.*not written by a member of this group"):
        target.receive(0, 0)
    # Raw JSON with no MAC at all is refused the same way.
    attacker.set(ExchangeEndpoint.header_key(1, 0), b'{"version": 1, "tensors": []}')
    with pytest.raises(ExchangeHeaderError, match="failed authentication"):
        target.receive(1, 0)


def test_a_pickle_payload_in_the_header_key_is_never_run(pair, tmp_path):
    _, target, port = pair
    marker = tmp_path / "planted-code-ran"
    attacker = _attacker(port, "policy_to_reference")
    attacker.set(ExchangeEndpoint.header_key(0, 0), pickle.dumps(PlantedPayload(str(marker))))
    with pytest.raises(ExchangeHeaderError, match="failed authentication"):
        target.receive(0, 0)
    assert not marker.exists()
    # The guard is not only the MAC: a pickle under a valid MAC is still parsed as JSON, never unpickled.
    secret = secrets.token_bytes(32)
    payload = pickle.dumps(PlantedPayload(str(marker)))
    value = hmac.new(secret, MAC_DOMAIN + b"\x00k\x00" + payload, hashlib.sha256).digest() + payload
    with pytest.raises(ExchangeHeaderError, match="is not JSON"):
        decode_header(secret, "k", value)
    assert not marker.exists()


# The refused bucket's sends have no receiver and end only at the group's timeout: a short one.
REFUSED_TIMEOUT_S = 5.0


@pytest.mark.slow
def test_a_member_with_another_secret_is_refused():
    source, target, _ = _open_pair("wrong_secret", secrets.token_bytes(32), secrets.token_bytes(32),
                                   timeout_s=REFUSED_TIMEOUT_S)
    try:
        sender = _send_in_thread(source, 0, _tensors())
        with pytest.raises(ExchangeHeaderError, match="failed authentication"):
            target.receive(0, 0)
        source.close()  # the sender's bucket sends have no receiver: end them
        sender.join(timeout=TIMEOUT_S + 10)
    finally:
        target.close()
        source.close()


def test_a_header_cannot_be_replayed_under_another_key():
    secret = secrets.token_bytes(32)
    value = encode_header(secret, "stacx-exchange/g/0/meta/0", [TensorSlot("w", "float32", (2,), 0, 0, 8)])
    assert decode_header(secret, "stacx-exchange/g/0/meta/0", value)[0].shape == (2,)
    with pytest.raises(ExchangeHeaderError, match="failed authentication"):
        decode_header(secret, "stacx-exchange/g/1/meta/0", value)  # a later transfer
    with pytest.raises(ExchangeHeaderError, match="failed authentication"):
        decode_header(secret, "stacx-exchange/other/0/meta/0", value)  # another group


@pytest.mark.parametrize("slot, error", [
    (TensorSlot("w", "object", (2,), 0, 0, 8), r"field 'dtype' is 'object', not one of bool"),
    (TensorSlot("w", "float32", (2,), 0, 0, 9), r"field 'num_bytes' is 9, but shape \[2\] of float32 holds 8"),
    (TensorSlot("w", "float32", (-2,), 0, 0, 8), r"field 'shape' must be a list of non-negative ints"),
    (TensorSlot("w", "float32", (2,), 0, 2, 8), r"field 'offset' 2 is not a multiple of the float32 element size"),
    (TensorSlot("w", "float32", (2,), -1, 0, 8), r"field 'bucket' must be a non-negative int"),
])
def test_an_authentic_but_malformed_header_names_the_field(slot, error):
    secret = secrets.token_bytes(32)
    with pytest.raises(ExchangeHeaderError, match=error):
        decode_header(secret, "k", encode_header(secret, "k", [slot]))


def test_every_table_dtype_round_trips_and_others_are_named():
    secret = secrets.token_bytes(32)
    tensors = {name: torch.zeros(3, dtype=dtype) for name, dtype in TENSOR_DTYPES.items()}
    slots, _ = plan_buckets(tensors, 1 << 20)
    assert decode_header(secret, "k", encode_header(secret, "k", slots)) == slots
    with pytest.raises(ValueError, match="tensor 'q' has dtype torch.qint8.*supported: bool"):
        plan_buckets({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, 1024)


def test_secrets_must_be_random_bytes():
    with pytest.raises(ValueError, match="exchange group 'g': secret must be at least 16 random bytes.*got 4 bytes"):
        check_secret(b"abcd", "exchange group 'g'")
    with pytest.raises(ValueError, match="got str"):
        check_secret("a" * 32, "exchange group 'g'")
