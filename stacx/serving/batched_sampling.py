"""One decoding step's token choices for a whole batch, with the draws `sample_token` makes row by row.

`CpuEngine` chose each row's token by itself (stacx.serving.cpu_engine.sample_token): at a vocab of 32k
and 16 rows, a sampled step spent ~6 tensor calls per row in Python. `choose_tokens` makes the same
choices with a handful of batched calls: greedy rows take the argmax of their log-probs (`first_argmax`); sampling rows
draw together (softmax in float64, cumulative mass, one uniform draw per row from that row's own
generator, in row order, inverted by a batched search), which is `draw_index`'s arithmetic row for
row, so a seed reproduces the same tokens as before and as the packed decoder. Rows with a top-k /
top-p filter get their filtered distribution (`filter_top_k_top_p`) row by row first.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from stacx.wire.types import SamplingParams


def _filters(sampling: SamplingParams, vocab_size: int) -> bool:
    return (0 < sampling.top_k < vocab_size) or sampling.top_p < 1.0


def draw_rows(probs_SV: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """Per row, one index drawn with probability `probs_SV[row]` (float64, any positive total) by
    inverting the cumulative mass at one uniform draw from `generators[row]` (`draw_index` per row)."""
    cumulative_SV = torch.cumsum(probs_SV, dim=1)
    uniforms_S1 = torch.cat([torch.rand(1, generator=g, dtype=cumulative_SV.dtype) for g in generators]).unsqueeze(1)
    targets_S1 = uniforms_S1 * cumulative_SV[:, -1:]
    indices = torch.searchsorted(cumulative_SV, targets_S1, right=True).squeeze(1).tolist()
    vocab_size = probs_SV.shape[1]
    for row, index in enumerate(indices):
        if index >= vocab_size:  # rounding put the target at the total: the last possible index
            indices[row] = int(torch.nonzero(probs_SV[row])[-1])
    return indices


ARGMAX_BLOCK = 128
"""Columns per block of `first_argmax`'s first pass."""


def first_argmax(x_BV: torch.Tensor) -> torch.Tensor:
    """`x_BV.argmax(dim=-1)` (the first maximum of each row, NaN counted as the maximum), in less time at a
    large vocabulary: torch's CPU argmax is a scalar loop (0.49 ms for [16, 32000] on one core), its max a
    vectorized one (0.04 ms). So: the max of each block of `ARGMAX_BLOCK` columns, the first block holding the
    row's maximum, the first maximum inside it (0.09 ms in all); the columns past the last whole block are
    compared at the end."""
    batch, vocab_size = x_BV.shape
    num_blocks = vocab_size // ARGMAX_BLOCK
    if num_blocks < 16:
        return x_BV.argmax(dim=-1)
    blocked_BNK = x_BV[:, :num_blocks * ARGMAX_BLOCK].reshape(batch, num_blocks, ARGMAX_BLOCK)
    block_B = blocked_BNK.amax(dim=-1).argmax(dim=-1)
    index_B = block_B * ARGMAX_BLOCK + blocked_BNK[torch.arange(batch), block_B].argmax(dim=-1)
    if num_blocks * ARGMAX_BLOCK < vocab_size:
        tail_max_B, tail_index_B = x_BV[:, num_blocks * ARGMAX_BLOCK:].max(dim=-1)
        best_B = x_BV.gather(1, index_B.unsqueeze(1)).squeeze(1)
        later_wins_B = (tail_max_B > best_B) | (tail_max_B.isnan() & ~best_B.isnan())
        index_B = torch.where(later_wins_B, num_blocks * ARGMAX_BLOCK + tail_index_B, index_B)
    return index_B


def choose_tokens(log_probs_BV: torch.Tensor, samplings: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator], filter_top_k_top_p: Callable) -> list[int]:
    """The next token of every row: `sample_token(log_probs_BV[row], samplings[row], generators[row])`
    for each row, in fewer calls (see the module docstring). Rows draw in row order, as before, so rows
    sharing one generator (unseeded requests) get the same draws too. `filter_top_k_top_p`: the
    engine's filter (log-probs [V], top_k, top_p) -> log-probs with the dropped tokens at -inf."""
    vocab_size = log_probs_BV.shape[1]
    tokens = [0] * len(samplings)
    greedy = [row for row, s in enumerate(samplings) if s.temperature == 0]
    sampled = [row for row, s in enumerate(samplings) if s.temperature != 0]
    if greedy:
        rows_log_probs = log_probs_BV if len(greedy) == len(samplings) else log_probs_BV.index_select(0, torch.tensor(greedy))
        for row, token in zip(greedy, first_argmax(rows_log_probs).tolist()):
            tokens[row] = token
    if sampled:
        rows_log_probs = log_probs_BV if len(sampled) == len(samplings) else log_probs_BV.index_select(0, torch.tensor(sampled))
        probs_SV = torch.softmax(rows_log_probs.double(), dim=-1)
        for position, row in enumerate(sampled):
            sampling = samplings[row]
            if _filters(sampling, vocab_size):
                filtered_V = filter_top_k_top_p(log_probs_BV[row], sampling.top_k, sampling.top_p)
                probs_SV[position] = torch.softmax(filtered_V.double(), dim=-1)
        for row, token in zip(sampled, draw_rows(probs_SV, [generators[row] for row in sampled])):
            tokens[row] = token
    return tokens
