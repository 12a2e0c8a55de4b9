"""Counts torch.distributed collective calls made inside a spawned rank (test helper)."""

from __future__ import annotations

import torch.distributed as dist

#: torch renamed all_gather_into_tensor to all_gather_single; count whichever Stacx calls.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def install_collective_counter() -> dict[str, int]:
    """Wrap dist.all_reduce and the flat all-gather; returns the live counts {"all_gather": n, "all_reduce": n}."""
    counts = {"all_gather": 0, "all_reduce": 0}
    for key, name in (("all_gather", ALL_GATHER), ("all_reduce", "all_reduce")):
        original = getattr(dist, name)

        def wrapper(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)
    return counts
