"""Megatron's load-balanced context-parallel layout for packed sequences (pure index math).

A packed row holds several sequences back to back. Under CP each sequence is padded to a
multiple of 2*cp and cut into 2*cp equal chunks; CP rank r holds chunks r and 2*cp-1-r of
every sequence, so causal attention work is balanced across ranks. A rank's local row is, for
each sequence in order, [chunk r, chunk 2*cp-1-r].

Everything here is index arithmetic on lengths: no process groups, no model. Slicing any
per-token field for a rank is `field_padded[local_positions(...)]`.
"""

from __future__ import annotations

from typing import Sequence

import torch


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def cp_padded_lengths(lengths: Sequence[int], cp_size: int) -> list[int]:
    """Each length rounded up to a multiple of 2*cp_size (unchanged when cp_size == 1)."""
    multiple = 2 * cp_size if cp_size > 1 else 1
    return [round_up(int(n), multiple) for n in lengths]


def sequence_parallel_padding(num_local_tokens: int, tp_size: int, cp_size: int) -> int:
    """Global length of one padding sequence, appended to a packed row, that makes each CP rank's row
    a multiple of tp (sequence parallelism splits it over TP). 0 when it already is.

    The padding sequence is itself a multiple of 2*cp (each CP rank gets length // cp of it, at the end
    of its row); a rank's row is even under CP, so with an even tp an even share always exists.
    """
    share = -num_local_tokens % tp_size  # padding tokens per CP rank
    if cp_size > 1 and share % 2:
        share += tp_size  # odd tp: an even share that still completes a multiple of tp
    return share * cp_size


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """Cumulative offsets [0, l0, l0+l1, ...] as int32, the form attention kernels take."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if len(lengths):
        out[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
    return out


def local_positions(padded_lengths: Sequence[int], cp_rank: int, cp_size: int) -> torch.Tensor:
    """Indices into the padded global packed row that CP rank `cp_rank` holds, in local order.

    padded_lengths: per-sequence lengths, each a multiple of 2*cp_size (see cp_padded_lengths).
    Returns a LongTensor of shape [sum(padded_lengths) // cp_size].
    """
    if cp_size == 1:
        return torch.arange(sum(padded_lengths), dtype=torch.long)
    pieces = []
    start = 0
    for length in padded_lengths:
        if length % (2 * cp_size):
            raise ValueError(f"padded length {length} is not a multiple of 2*cp_size={2 * cp_size}")
        chunk = length // (2 * cp_size)
        for chunk_id in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + chunk_id * chunk, start + (chunk_id + 1) * chunk))
        start += length
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def position_ids(padded_lengths: Sequence[int]) -> torch.Tensor:
    """Each token's position inside its own sequence, over the padded global packed row."""
    return torch.cat([torch.arange(n) for n in padded_lengths]) if padded_lengths else torch.zeros(0, dtype=torch.long)


def pad_packed(values: torch.Tensor, lengths: Sequence[int], padded_lengths: Sequence[int], fill=0) -> torch.Tensor:
    """Insert padding after each sequence of a packed 1-D (or [T, ...]) tensor."""
    pieces = []
    for piece, length, padded in zip(values.split(list(lengths)), lengths, padded_lengths):
        pieces.append(piece)
        if padded > length:
            pieces.append(values.new_full((padded - length, *values.shape[1:]), fill))
    return torch.cat(pieces) if pieces else values
