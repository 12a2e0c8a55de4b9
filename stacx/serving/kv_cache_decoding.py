"""Batched decoding with a KV cache on a `transformers` mirror of the engine's megatron GPTModel.

The trainer's megatron model stays the one source of weights (checkpoint loads and weight
updates land in it, with their name and completeness checks). `KvCacheDecoder` keeps a
`transformers` causal LM of the same config whose parameters are copied from the megatron
model, as Hugging Face-named tensors, the first time it decodes after any weight change
(`mark_stale()`). Decoding then runs `transformers`' cached forward:

    prefill:  one forward over the left-padded prompts [B, L_max] -> KV cache, logits of the
              last K positions [B, K, V] (K = 1 unless prompt log-probs are asked for)
    step:     one forward over the B newest tokens [B, 1] against the cache -> logits [B, V]

so a batch of N new tokens costs N small forwards instead of N forwards of the whole
(prompt + tokens so far) rows. Finished rows leave the cache (`CachedBatch.keep_rows`).
For dense llama/qwen2/qwen3 models the forward is `DenseKvDecoder` (dense_kv_decoding.py), a
lean one, and the mirror holding its parameters is `DenseMirror` (dense_mirror.py), built without
`transformers` (start-up time); `transformers`' model and forward serve the other models.

Why this route (docs/performance.md, "Generation"): on CPU it is as fast as Hugging Face
`generate` on the same weights, and its fp32 log-probs agree with the trainer's packed forward
to about 1e-6 (tested to 1e-5). The cost is a second copy of the weights in the engine process.
"""

from __future__ import annotations

import inspect
import re
from typing import Sequence

import torch

from stacx.serving.dense_kv_decoding import DenseKvDecoder
from stacx.serving.dense_mirror import DenseMirror


def _growing_layer_class():
    """A `transformers` DynamicLayer that writes into a preallocated [B, H, capacity, D] buffer
    instead of concatenating (which copies the whole cache at every step: O(steps^2) bytes).
    None when this `transformers` has no per-layer cache API (< 4.56): the plain cache is used."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class GrowingLayer(DynamicLayer):
        """Keys/values are views [B, H, length, D] of buffers [B, H, capacity, D]; capacity doubles
        when a write would overflow it."""

        def __init__(self, capacity: int):
            super().__init__()
            self._capacity = capacity
            self._length = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            batch, heads, _, _ = key_states.shape
            self._key_buffer = key_states.new_empty(batch, heads, self._capacity, key_states.shape[-1])
            self._value_buffer = value_states.new_empty(batch, heads, self._capacity, value_states.shape[-1])
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self._length + key_states.shape[-2]
            if end > self._key_buffer.shape[2]:
                self._key_buffer = self._grown(self._key_buffer, end)
                self._value_buffer = self._grown(self._value_buffer, end)
            self._key_buffer[:, :, self._length:end] = key_states
            self._value_buffer[:, :, self._length:end] = value_states
            self._length = end
            self._set_views()
            return self.keys, self.values

        def _grown(self, buffer, needed: int):
            grown = buffer.new_empty(*buffer.shape[:2], max(needed, 2 * buffer.shape[2]), buffer.shape[3])
            grown[:, :, :self._length] = buffer[:, :, :self._length]
            return grown

        def _set_views(self) -> None:
            self.keys = self._key_buffer[:, :, :self._length]
            self.values = self._value_buffer[:, :, :self._length]

        def batch_select_indices(self, indices) -> None:
            if self.is_initialized:
                self._key_buffer = self._key_buffer[indices]
                self._value_buffer = self._value_buffer[indices]
                self._set_views()

    return GrowingLayer


def new_cache(config, capacity: int):
    """An empty KV cache for `config`'s model holding up to `capacity` positions without copying."""
    # Imported here: transformers is slow to import (start-up time).
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
    growing_layer = _growing_layer_class()
    layers = getattr(cache, "layers", None)
    if growing_layer is not None and layers and all(type(layer).__name__ == "DynamicLayer" for layer in layers):
        cache.layers = [growing_layer(capacity) for _ in layers]
    return cache


class CachedBatch:
    """One batch being decoded: its KV cache, its attention mask and the rows still in it.

    Row r of every tensor is the r-th row still in the batch (rows leave with `keep_rows`).
    """

    def __init__(self, decoder: "KvCacheDecoder", attention_mask_BT: torch.Tensor, cache,
                 prompt_logits_BKV: torch.Tensor):
        self._decoder = decoder
        self._attention_mask_BT = attention_mask_BT
        # prompts of one length need no mask: the model's plain causal path is cheaper per step
        self._padded = not bool(attention_mask_BT.all())
        self._cache = cache
        self.prompt_logits_BKV = prompt_logits_BKV
        """fp32 logits [B, K, V] of each prompt's last K positions (left padding: position p of a
        prompt of length L is at index K - L + p)."""
        self.last_routes_BSLK = decoder.take_routes(len(attention_mask_BT))
        """While the decoder records routes: the experts of the last forward's tokens [B, S, MoE layers,
        top_k] (the prefill's left-padded [B, L_max, ...], then each step's [B, 1, ...]); else None."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not in `rows` (indices into the current batch, in the order to keep)."""
        if len(rows) == self._attention_mask_BT.shape[0]:
            return
        index = torch.tensor(list(rows), dtype=torch.long)
        self._cache.batch_select_indices(index)
        self._attention_mask_BT = self._attention_mask_BT[index]

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token per row; return the fp32 logits [B, V] of the next position."""
        # position of the new token = number of real (non-pad) tokens before it
        position_ids_B1 = self._attention_mask_BT.sum(dim=1, keepdim=True)
        ones_B1 = torch.ones_like(position_ids_B1)
        self._attention_mask_BT = torch.cat([self._attention_mask_BT, ones_B1], dim=1)
        output = self._decoder.forward(
            torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1),
            self._attention_mask_BT if self._padded else None, position_ids_B1, self._cache, num_logits=1)
        self.last_routes_BSLK = self._decoder.take_routes(len(tokens))
        return output.logits[:, -1].float()


_PER_EXPERT_NAME = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fused_expert_slice(params: dict, name: str):
    """(the tensor of the mirror that a Hugging Face-named weight lands in, the parameter's name).

    Checkpoints (and `iter_hf_weight_buckets`) name each routed expert's projections
    `...mlp.experts.{e}.{gate,up,down}_proj.weight`; `transformers` >= 5 holds a layer's experts fused,
    `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, then up) and `...mlp.experts.down_proj`
    [E, H, I]. A name the mirror holds as is maps to itself; (None, name) when it holds neither.
    """
    if name in params:
        return params[name], name
    match = _PER_EXPERT_NAME.fullmatch(name)
    if match is None:
        return None, name
    prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
    if projection == "down_proj":
        fused_name = f"{prefix}.down_proj"
        return (params[fused_name][expert], fused_name) if fused_name in params else (None, name)
    fused_name = f"{prefix}.gate_up_proj"
    if fused_name not in params:
        return None, name
    fused_EIH = params[fused_name]
    intermediate = fused_EIH.shape[1] // 2
    rows = slice(0, intermediate) if projection == "gate_proj" else slice(intermediate, 2 * intermediate)
    return fused_EIH[expert, rows], fused_name


class KvCacheDecoder:
    """A `transformers` model mirroring `gpt_model`'s weights, decoding batches with a KV cache.

    gpt_model: a single-process megatron GPTModel built by `stacx.models.build_model`.
    groups: its (trivial) ProcessGroups, used to read its weights under Hugging Face names.
    lean_mirror: hold a dense model's weights in `DenseMirror` (no `transformers` model is built); False
        builds `transformers`' model for every architecture (its own forward then serves when `dense` is None).
    """

    def __init__(self, gpt_model, groups, *, lean_mirror: bool = True):
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import hf_config_of
        from stacx.models.architectures import decoder_shape

        self._gpt_model = gpt_model
        self._groups = groups
        dtype = next(gpt_model.parameters()).dtype
        config = hf_config_of(gpt_model)
        self.vocab_size = int(config.vocab_size)
        self._stale = True
        if lean_mirror and DenseMirror.supports(decoder_shape(config)):
            self.hf_model = DenseMirror(decoder_shape(config), dtype).eval()
            self._cache_argument = None  # DenseMirror has no forward: DenseKvDecoder decodes on it
        else:
            # Imported here: transformers (and the conversion to its config) is slow to import (start-up time).
            from transformers import AutoModelForCausalLM
            from stacx.models.hf_config import as_transformers_config

            self.hf_model = AutoModelForCausalLM.from_config(as_transformers_config(config), dtype=dtype).eval()
            self.hf_model.requires_grad_(False)
            # transformers 5.x names the cache argument `cache` (`past_key_values` is deprecated there)
            forward_arguments = inspect.signature(self.hf_model.forward).parameters
            self._cache_argument = "cache" if "cache" in forward_arguments else "past_key_values"
        self.record_routes = False
        """Set by the engine for calls that return routed experts: each forward keeps its routes."""
        self._gates = [module for name, module in self.hf_model.named_modules() if name.endswith(".mlp.gate")]
        self._routes_per_gate: list[torch.Tensor] = []
        for gate in self._gates:
            gate.register_forward_hook(self._keep_routes)
        self.dense = DenseKvDecoder(self.hf_model) if DenseKvDecoder.supports(self.hf_model) else None
        """The lean forward of dense Llama-family models (dense_kv_decoding.py), None for other
        architectures; decoding uses it unless routes are recorded. Set to None to use `transformers`' (only
        on a mirror built with `lean_mirror=False`)."""

    def _keep_routes(self, _module, _inputs, outputs) -> None:
        # transformers' MoE routers return (router_logits, top-k weights, top-k expert ids [B*S, k])
        if self.record_routes:
            self._routes_per_gate.append(outputs[2])

    def take_routes(self, batch_size: int):
        """The routes the last forward recorded, [B, S, MoE layers, top_k] int32 ids ascending per row
        (None when not recording); the record is cleared."""
        if not self.record_routes:
            return None
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models.routing_replay import ROUTE_DTYPE

        assert len(self._routes_per_gate) == len(self._gates), "one routed forward per gate was expected"
        routes_NLK = torch.stack(self._routes_per_gate, dim=1).sort(dim=-1).values.to(ROUTE_DTYPE)
        self._routes_per_gate = []
        return routes_NLK.view(batch_size, -1, *routes_NLK.shape[1:])

    def mark_stale(self) -> None:
        """The megatron model's weights changed: copy them again before the next decoding."""
        self._stale = True

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy every megatron parameter, under its Hugging Face name(s), into the mirror.

        Raises AssertionError if a mirror parameter was not written (a mapping gap: a bug).
        """
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import iter_hf_weight_buckets

        params = dict(self.hf_model.named_parameters())  # tied weights appear once
        written = set()
        for bucket in iter_hf_weight_buckets(self._gpt_model, self._groups, bucket_bytes=1 << 62):
            for name, tensor in bucket:
                target, param_name = fused_expert_slice(params, name)
                if target is None:
                    assert name == "lm_head.weight" and self.hf_model.config.tie_word_embeddings, name
                    continue
                target.copy_(tensor)
                written.add(param_name)
        missing = sorted(set(params) - written)
        assert not missing, f"the KV-cache mirror received no weights for {missing[:5]}"
        if self.dense is not None:
            self.dense.pack_weights()
        self._stale = False

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], num_prompt_logits: int = 1,
                max_new_tokens: int = 0) -> CachedBatch:
        """Run the left-padded prompts [B, L_max] once; keep logits of the last `num_prompt_logits`.

        Every prompt must hold at least one token. The cache is sized for L_max + max_new_tokens.
        """
        if self._stale:
            self.sync_weights()
        if self.dense is not None and not self.record_routes:
            return self.dense.prefill(prompts, num_prompt_logits, max_new_tokens)
        lengths = [len(p) for p in prompts]
        assert min(lengths) > 0, "the KV-cache decoder needs a non-empty prompt"
        max_length = max(lengths)
        capacity = max_length + max(1, max_new_tokens)
        input_ids_BT = torch.zeros(len(prompts), max_length, dtype=torch.long)
        attention_mask_BT = torch.zeros(len(prompts), max_length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids_BT[row, max_length - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask_BT[row, max_length - len(prompt):] = 1
        position_ids_BT = (attention_mask_BT.cumsum(dim=1) - 1).clamp(min=0)
        cache = new_cache(self.hf_model.config, capacity)
        padded = min(lengths) < max_length
        output = self.forward(input_ids_BT, attention_mask_BT if padded else None, position_ids_BT, cache,
                              num_logits=max(1, min(num_prompt_logits, max_length)))
        return CachedBatch(self, attention_mask_BT, cache, output.logits.float())

    def forward(self, input_ids_BS, attention_mask_BT, position_ids_BS, cache, *, num_logits: int):
        """The mirror's cached forward of S new tokens per row (T = cached + S mask columns)."""
        return self.hf_model(input_ids=input_ids_BS, attention_mask=attention_mask_BT, position_ids=position_ids_BS,
                             use_cache=True, logits_to_keep=num_logits, **{self._cache_argument: cache})
