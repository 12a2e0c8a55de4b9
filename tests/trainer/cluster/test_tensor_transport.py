"""Plain CPU tensors travel through Ray as their raw bytes (stacx.trainer.cluster.ray.tensor_transport): equal
values, dtypes and shapes after the trip, out of band (never a `torch.save` per tensor), and every other
tensor as before. A real trip through Ray is every Ray run's (the demo's, the loop's tests)."""

from __future__ import annotations

import pickle

import pytest
import torch

from stacx.trainer.cluster.ray.connect import connect_ray
from stacx.trainer.cluster.ray.tensor_transport import tensor_from_payload, tensor_to_payload
from tests.trainer.cluster.fake_ray import fake_local_ray


def _trip(tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Through the payload and pickle protocol 5, as Ray sends it: (the rebuilt tensor, out-of-band buffers)."""
    buffers: list = []
    data = pickle.dumps(tensor_to_payload(tensor), protocol=5, buffer_callback=buffers.append)
    return tensor_from_payload(pickle.loads(data, buffers=buffers)), buffers


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.randn(5, 3).to(torch.bfloat16),
    torch.randn(7).to(torch.float16),
    torch.arange(10, dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.tensor(3.5, dtype=torch.float64),  # 0-dim
    torch.zeros(0, 4),  # empty
    torch.arange(24, dtype=torch.int32).reshape(4, 6)[:, 1::2],  # a non-contiguous view
    torch.randn(3, 2).t(),  # transposed
], ids=["f32", "bf16", "f16", "i64", "bool", "0-dim", "empty", "strided-view", "transposed"])
def test_a_plain_tensor_arrives_equal_as_raw_bytes_out_of_band(tensor):
    rebuilt, buffers = _trip(tensor)
    assert rebuilt.dtype == tensor.dtype and rebuilt.shape == tensor.shape and torch.equal(rebuilt, tensor)
    assert rebuilt.is_contiguous()
    assert tensor_to_payload(tensor)[0] in ("numpy", "raw") and len(buffers) == 1  # the bytes are not pickled in band
    rebuilt.add_(1) if rebuilt.dtype != torch.bool else rebuilt.logical_not_()  # it owns writable memory
    assert not torch.equal(rebuilt, tensor) or tensor.numel() == 0


def test_a_dtype_numpy_lacks_travels_as_bytes_beside_its_dtype():
    tensor = torch.randn(4, 3).to(torch.bfloat16)
    assert tensor_to_payload(tensor)[:3] == ("raw", torch.bfloat16, (4, 3))
    assert tensor_to_payload(tensor.float())[0] == "numpy"


def test_a_view_carries_only_its_own_elements():
    whole = torch.arange(100_000, dtype=torch.float32)
    payload = tensor_to_payload(whole[10:20])
    assert payload[-1].nbytes == 10 * 4  # the default pickle sends the whole 400 kB storage


def test_a_tensor_that_needs_more_than_its_bytes_goes_through_torch_save():
    grad = torch.randn(3, requires_grad=True)
    rebuilt, _ = _trip(grad)
    assert tensor_to_payload(grad)[0] == "saved"
    assert rebuilt.requires_grad and torch.equal(rebuilt.detach(), grad.detach())


def test_every_connection_registers_the_transport_with_ray(monkeypatch):
    import ray

    registered = []
    fake_local_ray(monkeypatch, lambda **kwargs: None)
    monkeypatch.setattr(ray.util, "register_serializer", lambda cls, **kw: registered.append((cls, kw)))

    connect_ray(None, num_cpus=1, environ={})
    connect_ray("10.0.0.1:6379", environ={})
    assert [cls for cls, _ in registered] == [torch.Tensor, torch.Tensor]
    assert registered[0][1] == {"serializer": tensor_to_payload, "deserializer": tensor_from_payload}
