"""How a plain CPU tensor travels in a Ray call's arguments and results: as its raw bytes.

Ray pickles a `torch.Tensor` the way `pickle` does, which runs a whole `torch.save` of its storage on the
sending side and a `torch.load` on the receiving one: about 0.6 ms of CPU per tensor, however small. A
step's batch holds a few tensors per sample (loss masks, advantages, log-probs, the teacher's top-K...),
so a 128-sample GRPO step sent and received thousands of them, and a demo's role worker spent more of
its step deserializing its arguments than training. Here a plain tensor (CPU, strided, no autograd, not a
subclass such as `nn.Parameter`) is sent as a numpy array of its elements (a dtype numpy lacks, such as
bfloat16: its bytes, with dtype and shape beside them), which Ray passes out of band without pickling, and
rebuilt as a new contiguous tensor that owns its memory: a round trip of 128 samples x 6 small tensors
went from 450-500 ms to 42 ms of CPU (docs/testing.md, session 8). Any other tensor (CUDA, sparse,
quantized, requiring grad) goes through `torch.save` / `torch.load` as before.

What changes for the receiver: a tensor arrives contiguous, and two tensors that shared a storage when
sent arrive as two (what a view shared is copied into each); values, dtypes and shapes are unchanged.

    register_tensor_transport()   # in every process that sends tensors through Ray (driver, role workers)
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


_NUMPY_DTYPES = frozenset(("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
                           "complex64", "complex128"))
"""torch dtypes (by name) whose tensors `.numpy()` views as they are; any other (bfloat16, float8...) travels as
its bytes with its dtype beside them."""


def tensor_to_payload(tensor: torch.Tensor) -> tuple:
    """What is pickled instead of `tensor` (see the module docstring)."""
    import torch

    if (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.requires_grad
            and not tensor.is_quantized and not tensor.is_nested and not tensor.is_conj() and not tensor.is_neg()):
        plain = tensor.detach().contiguous()
        if str(plain.dtype).removeprefix("torch.") in _NUMPY_DTYPES:
            return ("numpy", plain.numpy())
        return ("raw", plain.dtype, tuple(plain.shape), plain.reshape(-1).view(torch.uint8).numpy())
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return ("saved", buffer.getvalue())


def tensor_from_payload(payload: tuple) -> torch.Tensor:
    """The tensor `tensor_to_payload` described."""
    import torch

    if payload[0] == "numpy":
        return torch.from_numpy(payload[1].copy())  # a copy: Ray hands the bytes over read-only
    if payload[0] == "raw":
        _, dtype, shape, raw = payload
        if raw.size == 0:
            return torch.empty(shape, dtype=dtype)
        # A copy: Ray hands the bytes over read-only, straight from its object store.
        return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)
    return torch.load(io.BytesIO(payload[1]), weights_only=False)


def register_tensor_transport() -> None:
    """Make this process send plain tensors through Ray as raw bytes (a driver after `ray.init`, or a Ray
    worker; it lasts for the process, across `ray.shutdown`). Only the sender registers: the receiver calls
    `tensor_from_payload`, which the payload names."""
    import ray
    import torch  # imported here: `connect` is imported by commands that never load torch

    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_payload, deserializer=tensor_from_payload)
