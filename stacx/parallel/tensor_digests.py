"""Per-tensor digests: did the engine load exactly the weights the trainer sent?

After a weight push the sender compares, tensor by tensor, the digest of what it sent with the
digest of what the inference engine now holds under the same Hugging Face name (see
`stacx.rollout.weight_check`). Both ends call `tensor_digest`, so the two are comparable:

    digest = tensor_digest(tensor, dtype=torch.bfloat16)   # the engine's dtype for floating tensors

The digest is SHA-256 of the tensor's bytes (contiguous, row-major) after casting a floating
tensor to `dtype` (the engine's parameter dtype: a bf16 engine holds bf16 values whatever the
sender's dtype), prefixed with the dtype and shape, so a reshaped or retyped tensor never matches (-0.0 counts as
+0.0).
Torch and the standard library only: the vLLM worker extension imports it from the engine's own
environment.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch


def tensor_digest(tensor: torch.Tensor, *, dtype: Optional[torch.dtype] = None) -> str:
    """Hex SHA-256 of `tensor` (cast to `dtype` first when both are floating point), its dtype and shape."""
    value = tensor.detach()
    if dtype is not None and value.dtype.is_floating_point and dtype.is_floating_point and value.dtype != dtype:
        value = value.to(dtype)
    if value.dtype.is_floating_point:
        value = value + 0.0  # -0.0 and +0.0 are one weight (a kernel may return either)
    value = value.contiguous().cpu()
    hasher = hashlib.sha256(f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}".encode())
    if value.numel():
        hasher.update(memoryview(value.view(-1).view(torch.uint8).numpy()))
    return hasher.hexdigest()
