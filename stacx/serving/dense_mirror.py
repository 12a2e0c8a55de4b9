"""The KV-cache mirror's parameters for a dense Llama-family decoder, built without `transformers`.

`KvCacheDecoder` (kv_cache_decoding.py) keeps a second copy of the engine's weights under Hugging Face
names and decodes on it. For dense llama/qwen2/qwen3 models the decoding itself is `DenseKvDecoder`
(dense_kv_decoding.py), which reads only parameter tensors, a few config fields and the rotary table;
building `transformers`' model to hold those tensors cost every `stacx serve` start the import of
`transformers`' configuration and modeling stack (its package scan, the model class, `torch._dynamo`
through its masking utilities): about 3.4 s of CPU measured in a process that had already imported torch
and megatron-core, for a model whose `forward` the dense path never calls.

`DenseMirror` holds the same parameters under the same names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`, tied to the embedding when the config
ties them) with the module attributes `DenseKvDecoder` reads, and computes the default rotary table as
`transformers`' rotary module does, operation for operation. It is built from the `DecoderShape` the
megatron model was built from (stacx.models.architectures), so it exists for exactly the models the
engine serves; `DenseMirror.supports(shape)` leaves mixture-of-experts models and scaled rotary
embeddings (llama3) to the `transformers` mirror. Its parameters start uninitialized: the first weight
sync writes every one of them (`KvCacheDecoder.sync_weights` checks that).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from stacx.models.architectures import DecoderShape


class _Projection(nn.Module):
    """A linear layer's parameters (`weight` [out, in], `bias` [out] or None), uninitialized."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None


class _Embedding(nn.Module):
    """An embedding table's parameter: `weight` [vocab, hidden], uninitialized."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)


class _NormWeight(nn.Module):
    """An RMSNorm's parameters: `weight` [width] and `variance_epsilon`, as `transformers`' RMSNorm names them."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps


class DefaultRotaryTable(nn.Module):
    """`transformers`' default rotary embedding (no scaling): `forward(x, position_ids)` -> cos, sin
    [batch, positions, head dim] in x's dtype, computed with the same operations in the same order."""

    rope_type = "default"

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _Attention(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype):
        super().__init__()
        q_width, kv_width = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = _Projection(shape.hidden_size, q_width, bias=shape.qkv_bias, dtype=dtype)
        self.k_proj = _Projection(shape.hidden_size, kv_width, bias=shape.qkv_bias, dtype=dtype)
        self.v_proj = _Projection(shape.hidden_size, kv_width, bias=shape.qkv_bias, dtype=dtype)
        self.o_proj = _Projection(q_width, shape.hidden_size, bias=False, dtype=dtype)
        if shape.architecture.qk_layernorm:
            self.q_norm = _NormWeight(shape.head_dim, shape.rms_norm_eps, dtype)
            self.k_norm = _NormWeight(shape.head_dim, shape.rms_norm_eps, dtype)
        self.head_dim = shape.head_dim
        self.scaling = shape.head_dim ** -0.5


class _Mlp(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = _Projection(shape.hidden_size, shape.ffn_hidden_size, bias=False, dtype=dtype)
        self.up_proj = _Projection(shape.hidden_size, shape.ffn_hidden_size, bias=False, dtype=dtype)
        self.down_proj = _Projection(shape.ffn_hidden_size, shape.hidden_size, bias=False, dtype=dtype)


class _Layer(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype):
        super().__init__()
        self.self_attn = _Attention(shape, dtype)
        self.mlp = _Mlp(shape, dtype)
        self.input_layernorm = _NormWeight(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.post_attention_layernorm = _NormWeight(shape.hidden_size, shape.rms_norm_eps, dtype)


class _Body(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = _Embedding(shape.vocab_size, shape.hidden_size, dtype)
        self.layers = nn.ModuleList(_Layer(shape, dtype) for _ in range(shape.num_layers))
        self.norm = _NormWeight(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.rotary_emb = DefaultRotaryTable(shape.head_dim, shape.rope_theta)


class DenseMirror(nn.Module):
    """A dense decoder's parameters under `transformers`' names, for `DenseKvDecoder` (module docstring)."""

    @staticmethod
    def supports(shape: DecoderShape) -> bool:
        """Whether this mirror holds `shape`'s model: a dense decoder with the default rotary embedding."""
        return shape.moe is None and shape.rope_scaling is None

    def __init__(self, shape: DecoderShape, dtype: torch.dtype):
        super().__init__()
        assert self.supports(shape), "DenseMirror holds dense decoders with the default rotary embedding only"
        self.model = _Body(shape, dtype)
        self.lm_head = _Projection(shape.hidden_size, shape.vocab_size, bias=False, dtype=dtype)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.config = SimpleNamespace(
            model_type=shape.architecture.model_type, hidden_act="silu", use_sliding_window=False, layer_types=None,
            rms_norm_eps=shape.rms_norm_eps, num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_kv_heads, tie_word_embeddings=shape.tie_word_embeddings,
            vocab_size=shape.vocab_size)
        """The config fields `DenseKvDecoder` and `KvCacheDecoder` read, as a `transformers` config names them."""
