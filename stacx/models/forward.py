"""Run a built model on one CP rank's slice of a packed row and return its TP-local logits.

    padded = cp_padded_lengths(lengths, cp)
    tokens_local = pad_packed(tokens, lengths, padded)[local_positions(padded, cp_rank, cp)]
    logits = forward_packed(model, tokens_local, padded, groups)   # [T_local, V_pad/tp] fp32
"""

from __future__ import annotations

from typing import Sequence

import torch

from stacx.models.builder import hf_config_of
from stacx.parallel.cp_layout import cu_seqlens, local_positions, position_ids


def packed_seq_params_for(padded_lengths: Sequence[int], groups):
    """megatron's thd PackedSeqParams for a packed row of sequences with these global padded lengths.

    The "padded" offsets are the global ones: megatron's thd RoPE divides them by cp to find
    each rank's chunks, and Stacx's core attention reads them to find sequence boundaries.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = cu_seqlens(padded_lengths)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    offsets = offsets.to(device)
    max_length = max(padded_lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=offsets,
        cu_seqlens_kv=offsets,
        cu_seqlens_q_padded=offsets,
        cu_seqlens_kv_padded=offsets,
        max_seqlen_q=max_length,
        max_seqlen_kv=max_length,
        cp_group=groups.cp,
    )


def forward_packed(model, tokens: torch.Tensor, padded_lengths: Sequence[int], groups) -> torch.Tensor:
    """TP-local logits [T_local, V_pad/tp] (fp32) for this CP rank's slice `tokens` [T_local].

    padded_lengths: the GLOBAL per-sequence lengths, each a multiple of 2*cp (cp_padded_lengths).
    Columns of vocab padding (global id >= the real vocab size) hold float32 min, so a softmax
    over the padded vocab equals the softmax over the real vocab.
    """
    padded_lengths = [int(n) for n in padded_lengths]
    cp_size = groups.cp_size
    expected = sum(padded_lengths) // cp_size
    if tokens.dim() != 1 or tokens.numel() != expected:
        raise ValueError(
            f"tokens must be this CP rank's 1-D slice of {expected} tokens "
            f"(sum(padded_lengths)={sum(padded_lengths)} / cp={cp_size}), got shape {tuple(tokens.shape)}"
        )
    bad = [n for n in padded_lengths if n <= 0 or n % (2 * cp_size if cp_size > 1 else 1)]
    if bad:
        raise ValueError(f"padded_lengths {bad} are not positive multiples of 2*cp={2 * cp_size}")
    positions = position_ids(padded_lengths)[local_positions(padded_lengths, groups.cp_rank, cp_size)]
    params = packed_seq_params_for(padded_lengths, groups)
    device = params.cu_seqlens_q.device
    logits = model(
        tokens.to(device)[None],  # [1, T_local]
        positions.to(device)[None],
        None,
        packed_seq_params=params,
    )  # [1, T_local, V_pad/tp]
    logits = logits[0].float()
    return mask_vocab_padding(logits, hf_config_of(model).vocab_size, groups.tp_rank)


def mask_vocab_padding(logits_local: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Fill the columns of this TP shard whose global vocab id is >= vocab_size with float32 min."""
    shard_width = logits_local.shape[-1]
    first_id = tp_rank * shard_width
    if first_id + shard_width <= vocab_size:
        return logits_local
    column_ids = torch.arange(first_id, first_id + shard_width, device=logits_local.device)
    return logits_local.masked_fill(column_ids >= vocab_size, torch.finfo(torch.float32).min)
