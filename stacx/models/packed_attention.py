"""Stacx's core attention for the CPU path: causal, packed (thd), grouped-query, context-parallel.

megatron's SelfAttention hands the core attention RoPE'd tensors:
- packed (`packed_seq_params.qkv_format == "thd"`): query [T_local, Hq, D], key/value
  [T_local, Hkv, D], where T_local is this CP rank's slice of the packed row in megatron's
  load-balanced layout (`stacx.parallel.cp_layout.local_positions`), and
  `cu_seqlens_q_padded` holds the GLOBAL padded sequence offsets;
- unpacked: query [S, B, Hq, D], key/value [S, B, Hkv, D], one sequence per batch row (no CP).

For each sequence s, with K_s, V_s its full (CP-gathered) keys/values and q a local query at
position p inside s:   out(q) = softmax(q K_s[:p+1]^T * scale) V_s[:p+1].
Attention never crosses a sequence boundary; padding keys sit after a sequence's real tokens,
so the causal mask already hides them from real queries.
Returns [T_local, Hq*D] (packed) or [S, B, Hq*D] (unpacked).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from stacx.parallel.collectives import gather_from_context_parallel, group_rank, group_size
from stacx.parallel.cp_layout import local_positions


def gather_kv_to_global_order(local_kv: torch.Tensor, padded_lengths: list[int], cp_group) -> torch.Tensor:
    """[T_local, H, D] on each CP rank -> [T_global, H, D] in the global padded packed order."""
    cp_size = group_size(cp_group)
    if cp_size == 1:
        return local_kv
    gathered = gather_from_context_parallel(local_kv, cp_group)  # [cp, T_local, H, D]
    order = torch.cat([local_positions(padded_lengths, r, cp_size) for r in range(cp_size)])
    # gathered.flatten(0, 1)[i] sits at global position order[i]; invert the permutation.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return gathered.flatten(0, 1)[inverse.to(local_kv.device)]


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padded_lengths: list[int],
    cp_group,
    softmax_scale: float,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries [T_local, Hq, D] against every sequence's keys.

    Returns [T_local, Hq, D] in the local order.
    """
    cp_size, cp_rank = group_size(cp_group), group_rank(cp_group)
    full_key = gather_kv_to_global_order(key, padded_lengths, cp_group)  # [T_global, Hkv, D]
    full_value = gather_kv_to_global_order(value, padded_lengths, cp_group)
    if not padded_lengths:
        return query.new_zeros(query.shape)
    # One split per tensor, not a slice per sequence: the backward of a split is one concatenation,
    # that of each slice a zero-filled [T, H, D] gradient (a cost quadratic in the sequence count).
    local_lengths = [length // cp_size for length in padded_lengths]
    queries = query.split(local_lengths)
    keys, values = full_key.split(padded_lengths), full_value.split(padded_lengths)
    outputs: list = [None] * len(padded_lengths)
    # Sequences of one padded length share their mask and query positions: one attention call for all
    # of them (a batch), not one per sequence. A row's result does not depend on the other rows of its
    # batch (each batch row and head is computed on its own), so the output is the per-sequence one.
    for length, indices in _indices_by_length(padded_lengths).items():
        # Positions (inside the sequence) of this rank's queries: chunks r and 2cp-1-r.
        q_pos = local_positions([length], cp_rank, cp_size).to(query.device)  # [Lq]
        allowed = q_pos[:, None] >= torch.arange(length, device=query.device)[None, :]  # [Lq, L]
        batch = len(indices)
        # [B*H, L, D]: heads of every sequence along one batch dimension, as a single sequence's
        # [H, L, D] is (GQA pairs query head b*Hq + h with key head b*Hkv + h*Hkv//Hq, as it should).
        q = torch.stack([queries[i] for i in indices]).transpose(1, 2).flatten(0, 1)  # [B*Hq, Lq, D]
        k = torch.stack([keys[i] for i in indices]).transpose(1, 2).flatten(0, 1)  # [B*Hkv, L, D]
        v = torch.stack([values[i] for i in indices]).transpose(1, 2).flatten(0, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=softmax_scale, enable_gqa=q.shape[0] != k.shape[0]
        )
        rows = out.unflatten(0, (batch, -1)).transpose(1, 2).unbind(0)  # [Lq, Hq, D] each
        for index, row in zip(indices, rows):
            outputs[index] = row
    return torch.cat(outputs)


def _indices_by_length(lengths: list[int]) -> dict[int, list[int]]:
    """The positions in `lengths` of each distinct length, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        groups.setdefault(length, []).append(index)
    return groups


class PackedCoreAttention(MegatronModule):
    """Drop-in `core_attention` for megatron's local layer spec (see the module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(head_dim)
        self.default_cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: Stacx's core attention implements no dropout")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by Stacx's core attention")
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return self._unpacked(query, key, value)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        padded_lengths = (cu[1:] - cu[:-1]).tolist()
        cp_group = packed_seq_params.cp_group or self.default_cp_group
        out = packed_causal_attention(query, key, value, padded_lengths, cp_group, self.softmax_scale)
        return out.reshape(out.shape[0], -1)

    def _unpacked(self, query, key, value):
        seq, batch, heads, dim = query.shape  # [s, b, h, d]
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            is_causal=True, scale=self.softmax_scale, enable_gqa=heads != key.shape[2],
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
