"""Causal SDPA core attention for one unpacked sequence per row (no packing, no CP).

The packed, CP-aware core attention of stacx.models supersedes this for real runs; this one
serves the foundation demo and the megatron CPU compat tests.
"""

import torch
from megatron.core.transformer.module import MegatronModule


class SdpaCoreAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        seq, batch, heads, dim = query.shape  # [s, b, h, d]
        repeat = heads // key.shape[2]
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), is_causal=True
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
