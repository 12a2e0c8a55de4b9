"""A lean cached forward for dense Llama-family decoders (llama, qwen2, qwen3), on the KV-cache mirror's weights.

`KvCacheDecoder` (kv_cache_decoding.py) decodes with `transformers`' model of the engine's config. At the
shapes the CPU engine serves (B = 16 rows, hidden 512, 8 layers, vocab 32k) that forward spends a third of
each decoding step outside arithmetic: per-layer module calls, mask and position bookkeeping, the cache
object's updates. `DenseKvDecoder` runs the same arithmetic on the same parameter tensors with
none of that:

    one fused q/k/v matmul and one fused gate/up matmul per layer (the mirror's q/k/v and gate/up
        parameters are views into one buffer each, so weight syncs write straight into them);
    a KV cache preallocated per call, [layers, B, kv heads, capacity, head dim], written in place;
    grouped-query attention by torch's CPU flash kernel (`scaled_dot_product_attention`, kv heads never
        repeated);
    rotary cos/sin looked up from a table computed once per call (the mirror's own rotary module);
    the lm head only on the positions whose logits are kept.

The engine picks it when `DenseKvDecoder.supports(hf_model)`; mixture-of-experts models, route
recording and other architectures keep the `transformers` path. Its fp32 log-probs agree with the
trainer's packed forward as the `transformers` path's do (tests/serving/test_dense_kv_decoding.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""`config.model_type`s whose decoder layer is RMSNorm -> attention (GQA, rotary, optional q/k/v bias,
optional per-head q/k RMSNorm) -> RMSNorm -> SwiGLU MLP, with every layer attending to all positions."""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`transformers`' RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, back to x's dtype, then the weight.
    The same operations in the same order, each result written into the tensor made by the one before
    where it can be (fewer allocations per decoding step; the same floats). The mean is written as torch's
    CPU kernel computes it, a sum divided in place, without `mean`'s own dispatch and copies around it."""
    x32 = x.float()
    normed = (x32 * x32.pow(2).sum(-1, keepdim=True).div_(x32.shape[-1]).add_(eps).rsqrt_()).to(x.dtype)
    return normed.mul_(weight) if weight.dtype == normed.dtype else weight * normed


def signed_sin_table(sin_PD: torch.Tensor) -> torch.Tensor:
    """sin [P, D] with its first half negated: what `_rotate` multiplies the half-swapped x by."""
    half = sin_PD.shape[-1] // 2
    return torch.cat((-sin_PD[..., :half], sin_PD[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as `transformers` applies it (rotate_half convention), bit for bit:
    x * cos + cat(-x2, x1) * sin, with the sign moved onto the table (`signed_sin_table`; (-a) * b and
    a * (-b) are the same float), which saves a negation of x per call."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))


def _fuse_parameters(modules: Sequence[torch.nn.Module], attribute: str) -> Optional[torch.Tensor]:
    """Concatenate `attribute` ("weight"/"bias") of `modules` along dim 0 into one buffer and make each
    module's parameter a view of its rows; None when the modules have no such parameter."""
    params = [getattr(module, attribute) for module in modules]
    if any(p is None for p in params):
        assert all(p is None for p in params), f"some but not all of the fused projections have a {attribute}"
        return None
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for param in params:
        param.data = fused[start:start + param.shape[0]]
        start += param.shape[0]
    return fused


PACKING_BATCH_HINT = 16
"""The rows per matmul oneDNN lays packed weights out for (decoding steps run B rows; any count works)."""


def onednn_packing_available() -> bool:
    """Whether this torch can run linears on oneDNN-packed fp32 weights (x86 and arm builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear:
    """y = x W^T + b on a weight laid out once for oneDNN's matmul (what vLLM's CPU backend does), or
    `F.linear` (MKL's GEMM) where oneDNN is unavailable or the weight is not fp32.

    Why: on AMD x86 CPUs torch's MKL sgemm runs [16, 512] x [512, 32000] (the lm head) about 2x slower
    than oneDNN on a pre-packed weight (docs/performance.md, "Generation against vLLM"). The packed copy
    is made by `pack()` after every weight sync; `weight`/`bias` stay views of the mirror's parameters.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        self.weight, self.bias = weight, bias
        self._packed: Optional[torch.Tensor] = None

    def pack(self, enabled: bool) -> None:
        """Lay the current weight out for oneDNN (enabled) or drop the packed copy (not enabled)."""
        self._packed = None
        if enabled and self.weight.dtype == torch.float32:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACKING_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


class _Layer:
    """One decoder layer's tensors (views of the mirror's parameters)."""

    def __init__(self, hf_layer):
        attention, mlp = hf_layer.self_attn, hf_layer.mlp
        self.qkv = PackedLinear(_fuse_parameters([attention.q_proj, attention.k_proj, attention.v_proj], "weight"),
                                _fuse_parameters([attention.q_proj, attention.k_proj, attention.v_proj], "bias"))
        self.o_proj = PackedLinear(attention.o_proj.weight, attention.o_proj.bias)
        self.q_norm = getattr(attention, "q_norm", None)
        self.k_norm = getattr(attention, "k_norm", None)
        self.gate_up = PackedLinear(_fuse_parameters([mlp.gate_proj, mlp.up_proj], "weight"))
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.down_proj = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.input_norm = hf_layer.input_layernorm.weight
        self.post_attention_norm = hf_layer.post_attention_layernorm.weight
        assert mlp.gate_proj.bias is None and mlp.up_proj.bias is None, "MLP biases are not supported"


class DenseKvDecoder:
    """The lean forward over a `transformers` Llama-family causal LM's parameters (see the module docstring).

    hf_model: the KV-cache mirror; built once, its q/k/v and gate/up parameters become views into
        fused buffers here (the mirror's own forward still works and reads the same values).
    """

    @staticmethod
    def supports(hf_model) -> bool:
        """Whether `hf_model` is a dense decoder this forward computes exactly as `transformers` does."""
        config = hf_model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
            return False
        if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ())):
            return False  # sliding-window layers
        if getattr(config, "use_sliding_window", False):
            return False
        rotary = getattr(hf_model.model, "rotary_emb", None)
        # "dynamic" rotary tables depend on the sequence length: a per-call table would differ
        return rotary is not None and getattr(rotary, "rope_type", "default") != "dynamic"

    def __init__(self, hf_model):
        config = hf_model.config
        self.hf_model = hf_model
        self.eps = float(config.rms_norm_eps)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        attention = hf_model.model.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.layers = [_Layer(layer) for layer in hf_model.model.layers]
        self.embed = hf_model.model.embed_tokens.weight
        self.final_norm = hf_model.model.norm.weight
        self.lm_head = PackedLinear(hf_model.lm_head.weight)  # the embedding itself when tied
        self.linears = [self.lm_head] + [linear for layer in self.layers
                                         for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
        self.use_onednn = onednn_packing_available()
        """Whether linears run on oneDNN-packed weights (`PackedLinear`); False runs `F.linear` (MKL)."""

    @torch.inference_mode()
    def pack_weights(self) -> None:
        """Lay every linear's weight out again (after each weight sync: the packed copies are not views)."""
        for linear in self.linears:
            linear.pack(self.use_onednn)

    @torch.inference_mode()
    def rotary_table(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [capacity, head dim] of positions 0..capacity-1 from the mirror's rotary module
        (element for element what it computes for any one position)."""
        positions_1P = torch.arange(capacity).unsqueeze(0)
        cos_1PD, sin_1PD = self.hf_model.model.rotary_emb(self.embed[:1].unsqueeze(0), positions_1P)
        return cos_1PD[0], sin_1PD[0]

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], num_prompt_logits: int = 1,
                max_new_tokens: int = 0) -> "DenseCachedBatch":
        """`KvCacheDecoder.prefill`'s contract: left-padded prompts [B, L_max] once, the logits of the last
        `num_prompt_logits` positions kept, a cache for L_max + max_new_tokens positions."""
        lengths = [len(p) for p in prompts]
        assert min(lengths) > 0, "the KV-cache decoder needs a non-empty prompt"
        max_length = max(lengths)
        capacity = max_length + max(1, max_new_tokens)
        batch = len(prompts)
        input_ids_BT = torch.zeros(batch, max_length, dtype=torch.long)
        real_BT = torch.zeros(batch, max_length, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids_BT[row, max_length - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            real_BT[row, max_length - len(prompt):] = True
        return DenseCachedBatch(self, input_ids_BT, real_BT, capacity, num_prompt_logits)

    def forward(self, input_ids_BS: torch.Tensor, positions_BS: torch.Tensor, cache: "DenseCachedBatch",
                bias_B1ST: Optional[torch.Tensor], num_logits: int) -> torch.Tensor:
        """S new tokens per row written at cache columns [cache.length, cache.length + S); returns the
        fp32 logits [B, num_logits, V] of the last `num_logits` of them. `bias_B1ST`: additive attention
        mask over the T = length + S columns (0 or -inf), None when every row may see every column."""
        batch, new = input_ids_BS.shape
        start, end = cache.length, cache.length + new
        cos_B1SD = cache.cos[positions_BS].unsqueeze(1)
        signed_sin_B1SD = cache.signed_sin[positions_BS].unsqueeze(1)
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        mask_B1ST = cache.attention_bias(bias_B1ST, new, end) if bias_B1ST is not None or new > 1 else None
        hidden_BSH = F.embedding(input_ids_BS, self.embed)
        for index, layer in enumerate(self.layers):
            x_BSH = _rms_norm(hidden_BSH, layer.input_norm, self.eps)
            qkv_BSF = layer.qkv(x_BSH)
            v_BSKD = qkv_BSF[..., q_size + kv_size:].view(batch, new, num_kv_heads, head_dim)
            if layer.q_norm is None:
                # q's and k's heads sit side by side in the fused output: one rotation for both
                qk_BHSD = _rotate(qkv_BSF[..., :q_size + kv_size].view(batch, new, num_heads + num_kv_heads, head_dim)
                                  .transpose(1, 2), cos_B1SD, signed_sin_B1SD)
                q_BNSD, k_BKSD = qk_BHSD[:, :num_heads], qk_BHSD[:, num_heads:]
            else:
                q_BSND = qkv_BSF[..., :q_size].view(batch, new, num_heads, head_dim)
                k_BSKD = qkv_BSF[..., q_size:q_size + kv_size].view(batch, new, num_kv_heads, head_dim)
                q_BSND = _rms_norm(q_BSND, layer.q_norm.weight, layer.q_norm.variance_epsilon)
                k_BSKD = _rms_norm(k_BSKD, layer.k_norm.weight, layer.k_norm.variance_epsilon)
                q_BNSD = _rotate(q_BSND.transpose(1, 2), cos_B1SD, signed_sin_B1SD)
                k_BKSD = _rotate(k_BSKD.transpose(1, 2), cos_B1SD, signed_sin_B1SD)
            keys_BKCD, values_BKCD = cache.keys[index], cache.values[index]
            keys_BKCD[:, :, start:end] = k_BKSD
            values_BKCD[:, :, start:end] = v_BSKD.transpose(1, 2)
            attended_BSF = self._attend(q_BNSD, keys_BKCD[:, :, :end], values_BKCD[:, :, :end], mask_B1ST)
            hidden_BSH.add_(layer.o_proj(attended_BSF))  # the residual stream is this call's own tensor
            x_BSH = _rms_norm(hidden_BSH, layer.post_attention_norm, self.eps)
            gate_up_BSF = layer.gate_up(x_BSH)
            gated_BSI = F.silu(gate_up_BSF[..., :layer.intermediate]).mul_(gate_up_BSF[..., layer.intermediate:])
            hidden_BSH.add_(layer.down_proj(gated_BSI))
        cache.length = end
        kept_BKH = _rms_norm(hidden_BSH[:, new - num_logits:], self.final_norm, self.eps)
        return self.lm_head(kept_BKH).float()

    def _attend(self, q_BNSD: torch.Tensor, keys_BKTD: torch.Tensor, values_BKTD: torch.Tensor,
                mask_B1ST: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T * scaling + mask) v for the N query heads, query head n reading kv head n // (N / K) as
        `transformers` repeats them; returns [B, S, N * head dim].

        Decoding (S = 1) hands torch's CPU flash kernel the G = N / K query heads of one kv head as G queries of
        that head ([B, K, G, D], the mask broadcast over them): one kernel task per (row, kv head) holding G
        queries instead of one task per query head holding one, 1.75x less time per layer at B = 16, G = 4
        (docs/performance.md, "Against vLLM on CPU"). The rows' arithmetic is the same softmax, summed in
        another order (~1e-7 apart). Prefill keeps the kernel's own grouped-query path (causal mask)."""
        batch, num_heads, new, head_dim = q_BNSD.shape
        num_kv_heads = keys_BKTD.shape[1]
        if new == 1:
            attended_BKGD = F.scaled_dot_product_attention(
                q_BNSD.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim), keys_BKTD, values_BKTD,
                attn_mask=mask_B1ST, scale=self.scaling)
            return attended_BKGD.reshape(batch, 1, num_heads * head_dim)
        attended_BNSD = F.scaled_dot_product_attention(q_BNSD, keys_BKTD, values_BKTD, attn_mask=mask_B1ST,
                                                       scale=self.scaling, enable_gqa=num_heads != num_kv_heads)
        return attended_BNSD.transpose(1, 2).reshape(batch, new, num_heads * head_dim)


class DenseCachedBatch:
    """`CachedBatch`'s interface (kv_cache_decoding.py) for `DenseKvDecoder`: one batch being decoded.

    Row r of every tensor is the r-th row still in the batch (rows leave with `keep_rows`).
    """

    def __init__(self, decoder: DenseKvDecoder, input_ids_BT: torch.Tensor, real_BT: torch.Tensor, capacity: int,
                 num_prompt_logits: int):
        self._decoder = decoder
        batch, length = input_ids_BT.shape
        shape = (len(decoder.layers), batch, decoder.num_kv_heads, capacity, decoder.head_dim)
        self.keys = decoder.embed.new_empty(shape)
        self.values = decoder.embed.new_empty(shape)
        self.length = 0
        self.cos, sin = decoder.rotary_table(capacity)
        self.signed_sin = signed_sin_table(sin)
        self._padded = not bool(real_BT.all())
        # additive key mask [B, 1, 1, capacity]: -inf on the left padding, 0 elsewhere (columns past the
        # prompt are generated tokens, always real)
        self._key_bias_B11C = torch.zeros(batch, 1, 1, capacity)
        self._key_bias_B11C[:, 0, 0, :length].masked_fill_(~real_BT, float("-inf"))
        self._next_position_B1 = real_BT.sum(dim=1, keepdim=True)
        positions_BT = (real_BT.long().cumsum(dim=1) - 1).clamp(min=0)
        self.prompt_logits_BKV = decoder.forward(input_ids_BT, positions_BT, self, self._key_bias_B11C,
                                                 num_logits=max(1, min(num_prompt_logits, length)))
        """fp32 logits [B, K, V] of each prompt's last K positions (left padding, as `CachedBatch`)."""
        self.last_routes_BSLK = None
        """Dense models route nothing."""

    def attention_bias(self, key_bias_B11C: Optional[torch.Tensor], new: int, end: int) -> torch.Tensor:
        """Additive mask [B or 1, 1, new, end] for `new` queries at columns [end - new, end): causal among
        the new tokens, the key padding bias on top. A query on a padding position sees itself (its
        output is never used, and a row of -inf alone would make NaN)."""
        bias = torch.zeros(1, 1, new, end)
        if new > 1:
            causal_SS = torch.ones(new, new, dtype=torch.bool).triu(1)
            bias[..., end - new:] = bias[..., end - new:].masked_fill(causal_SS, float("-inf"))
        if key_bias_B11C is not None:
            bias = bias + key_bias_B11C[..., :end]
            if new > 1:
                diagonal = torch.arange(new)
                bias[..., diagonal, end - new + diagonal] = 0.0
        return bias

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not in `rows` (indices into the current batch, in the order to keep)."""
        if len(rows) == self.keys.shape[1]:
            return
        index = torch.tensor(list(rows), dtype=torch.long)
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self._key_bias_B11C = self._key_bias_B11C.index_select(0, index)
        self._next_position_B1 = self._next_position_B1.index_select(0, index)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token per row; return the fp32 logits [B, V] of the next position."""
        positions_B1 = self._next_position_B1
        self._next_position_B1 = positions_B1 + 1
        logits_B1V = self._decoder.forward(torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1), positions_B1,
                                           self, self._key_bias_B11C if self._padded else None, num_logits=1)
        return logits_B1V[:, -1]
