"""Converting between per-trajectory lists and padded (batch, seq_len) tensors."""

from __future__ import annotations

from typing import Sequence

import torch


def pad_trajectories(tensors: Sequence[torch.Tensor], pad_value: float = 0.0, length: int | None = None) -> torch.Tensor:
    """List of (T_i,) tensors -> (B, max(T_i) or `length`) right-padded with `pad_value`.

    Differentiable with respect to the inputs (built with torch.cat, not in-place writes).
    """
    if not tensors:
        raise ValueError("pad_trajectories: no trajectories")
    width = max(t.shape[0] for t in tensors) if length is None else length
    rows = []
    for index, t in enumerate(tensors):
        if t.dim() != 1:
            raise ValueError(f"pad_trajectories: trajectory {index} must be 1-D, got {tuple(t.shape)}")
        if t.shape[0] > width:
            raise ValueError(f"pad_trajectories: trajectory {index} has length {t.shape[0]} > {width}")
        pad = t.new_full((width - t.shape[0],), pad_value)
        rows.append(torch.cat([t, pad]))
    return torch.stack(rows)


def unpad_trajectories(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """(B, T) -> list of (T_i,) views of the first T_i entries of each row."""
    if padded.dim() != 2 or padded.shape[0] != len(lengths):
        raise ValueError(f"unpad_trajectories: expected ({len(lengths)}, seq_len), got {tuple(padded.shape)}")
    if lengths and max(lengths) > padded.shape[1]:
        raise ValueError(f"unpad_trajectories: a length {max(lengths)} exceeds seq_len {padded.shape[1]}")
    return [padded[i, :n] for i, n in enumerate(lengths)]
