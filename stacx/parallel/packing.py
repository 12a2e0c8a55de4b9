"""Pack variable-length samples into micro-batches under a per-rank token budget, balanced over DP.

Every DP rank gets the same number of micro-batches M (DDP ranks must run the same number of
backward passes). M is the smallest count for which the samples fit into dp * M bins of
`max_tokens_per_micro_batch` tokens each (after rounding each sample up to `pad_multiple`, e.g.
2 * cp for CP's load-balanced chunks). Samples go, longest first, into the least-loaded bin
(LPT); the bins are then dealt to DP ranks, heaviest first, to the rank with the smallest total
that still has room. Tokens per bin and per rank end up close to the mean.

The split never changes the gradient (see reduction.py); packing only affects speed and memory.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from stacx.parallel.cp_layout import round_up


@dataclass(frozen=True, kw_only=True)
class PackingPlan:
    """Which samples each DP rank processes in each micro-batch."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """[dp_rank][micro_batch] -> indices of the samples packed together, in the input's index space."""
    padded_lengths: tuple[int, ...]
    """Each sample's length rounded up to pad_multiple (what it occupies in a micro-batch)."""
    lengths: tuple[int, ...]
    """Each sample's real length."""
    max_tokens_per_micro_batch: int
    """The budget every micro-batch respects (in padded tokens)."""

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per DP rank (the same on every rank)."""
        return len(self.micro_batches[0])

    def micro_batch_tokens(self) -> list[list[int]]:
        """[dp_rank][micro_batch] -> padded tokens."""
        return [[sum(self.padded_lengths[i] for i in mb) for mb in rank] for rank in self.micro_batches]

    @property
    def padding_fraction(self) -> float:
        """Padding tokens (alignment to pad_multiple) / all padded tokens."""
        padded = sum(self.padded_lengths)
        return (padded - sum(self.lengths)) / padded if padded else 0.0

    @property
    def rank_imbalance(self) -> float:
        """Largest DP rank's tokens / mean DP rank tokens (1.0 = perfectly balanced)."""
        totals = [sum(t) for t in self.micro_batch_tokens()]
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean else 1.0

    @property
    def micro_batch_imbalance(self) -> float:
        """Largest micro-batch's tokens / mean micro-batch tokens."""
        tokens = [t for rank in self.micro_batch_tokens() for t in rank]
        mean = sum(tokens) / len(tokens)
        return max(tokens) / mean if mean else 1.0


def _fill_bins(padded: Sequence[int], num_bins: int, budget: int) -> list[list[int]] | None:
    """LPT: longest first into the least-loaded bin; None when some sample does not fit."""
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for index in sorted(range(len(padded)), key=lambda i: (-padded[i], i)):
        load, b = heapq.heappop(heap)
        if load + padded[index] > budget:
            return None
        bins[b].append(index)
        heapq.heappush(heap, (load + padded[index], b))
    return bins


def _deal_bins_to_ranks(bins: list[list[int]], padded: Sequence[int], dp_size: int, per_rank: int):
    loads = [sum(padded[i] for i in b) for b in bins]
    ranks: list[list[tuple[int, ...]]] = [[] for _ in range(dp_size)]
    totals = [0] * dp_size
    for b in sorted(range(len(bins)), key=lambda b: (-loads[b], b)):
        rank = min((r for r in range(dp_size) if len(ranks[r]) < per_rank), key=lambda r: (totals[r], r))
        ranks[rank].append(tuple(sorted(bins[b])))
        totals[rank] += loads[b]
    return tuple(tuple(rank) for rank in ranks)


def pack_micro_batches(
    lengths: Sequence[int],
    *,
    dp_size: int,
    max_tokens_per_micro_batch: int,
    pad_multiple: int = 1,
    min_micro_batches: int = 1,
    micro_batch_multiple: int = 1,
) -> PackingPlan:
    """Plan micro-batches for one step's samples (lengths in tokens) over `dp_size` ranks: the smallest count
    per rank that fits, at least `min_micro_batches` and a multiple of `micro_batch_multiple`."""
    if dp_size < 1 or pad_multiple < 1 or min_micro_batches < 1 or micro_batch_multiple < 1:
        raise ValueError(
            f"dp_size ({dp_size}), pad_multiple ({pad_multiple}), min_micro_batches ({min_micro_batches}) and "
            f"micro_batch_multiple ({micro_batch_multiple}) must be >= 1"
        )
    if len(lengths) < dp_size:
        raise ValueError(f"{len(lengths)} samples cannot give every one of dp_size={dp_size} ranks a sample")
    padded = [round_up(int(n), pad_multiple) for n in lengths]
    too_long = [i for i, n in enumerate(padded) if n > max_tokens_per_micro_batch]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sample {i} has {padded[i]} tokens (padded to a multiple of {pad_multiple}), more than "
            f"max_tokens_per_micro_batch={max_tokens_per_micro_batch}"
        )
    per_rank = round_up(max(min_micro_batches, -(-sum(padded) // (dp_size * max_tokens_per_micro_batch))),
                        micro_batch_multiple)
    while True:
        bins = _fill_bins(padded, dp_size * per_rank, max_tokens_per_micro_batch)
        if bins is not None:
            break
        per_rank += micro_batch_multiple
    return PackingPlan(
        micro_batches=_deal_bins_to_ranks(bins, padded, dp_size, per_rank),
        padded_lengths=tuple(padded),
        lengths=tuple(int(n) for n in lengths),
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
    )
