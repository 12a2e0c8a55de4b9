"""A model's weights as the trainer would push them, digested per Hugging Face name: the engine's end of
the post-sync check for engines that hold a megatron model (`stacx serve`'s CPU engine).

    hf_weight_digests(model, groups, ["model.layers.0.mlp.up_proj.weight"])   # {name: digest}

The tensors are the HF export of the model's own parameters (`iter_hf_weight_buckets`), digested
with `stacx.parallel.tensor_digests.tensor_digest` in the model's parameter dtype, the same function
the sender uses (stacx.rollout.weight_check).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from stacx.parallel.groups import ProcessGroups
from stacx.parallel.tensor_digests import tensor_digest

DIGEST_BUCKET_BYTES = 64 << 20


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's floating parameters (the first one's)."""
    return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)


def hf_weight_digests(model, groups: ProcessGroups, names: Sequence[str], *, dtype: Optional[torch.dtype] = None) -> dict:
    """{name: digest or None (the model exports no tensor of that name)} for `names`."""
    # Imported here: megatron-core is slow to import (start-up time).
    from stacx.models import iter_hf_weight_buckets

    wanted = set(names)
    dtype = dtype or model_dtype(model)
    digests: dict[str, Optional[str]] = {name: None for name in names}
    # LoRA adapters (an engine taking adapter-only syncs) stream under their PEFT names, apart from the weights
    streams = (False, True) if any(".lora_" in name for name in wanted) else (False,)
    with torch.no_grad():
        for adapters in streams:
            for bucket in iter_hf_weight_buckets(model, groups, DIGEST_BUCKET_BYTES, only_to_tp_rank=0,
                                                 adapters=adapters):
                for name, tensor in bucket:
                    if name in wanted:
                        digests[name] = tensor_digest(tensor, dtype=dtype)
    return digests
