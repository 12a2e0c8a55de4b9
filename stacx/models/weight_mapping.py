"""How each megatron-core parameter corresponds to Hugging Face tensors, and how TP shards them.

A `ParamMapping` ties one megatron parameter (a TP shard) to one or more HF tensors (full) by a
*kind*:

| kind        | HF tensors          | megatron shard on TP rank r of tp                            |
| ----------- | ------------------- | ------------------------------------------------------------ |
| replicated  | one                 | the whole tensor (norms)                                     |
| row         | one [out, in]       | columns [r*in/tp, (r+1)*in/tp)  (o_proj, down_proj)          |
| vocab       | one [V, H]          | rows of the vocab padded to V_pad, [r*V_pad/tp, ...)         |
| qkv         | q, k, v             | KV groups [r*G/tp, (r+1)*G/tp), each as [q heads of g; k_g; v_g] |
| gate_up     | gate, up            | [gate rows r*F/tp..; up rows r*F/tp..] stacked               |

Routed experts (mixture-of-experts layers) use the same kinds, but over the *expert* tensor-parallel
group (etp) instead of tp: `ParamMapping.routed_expert` is set, and megatron's local expert j of
expert-parallel rank r is Hugging Face expert r * num_experts / ep + j (`local_expert_indices`).
Pick the shard coordinates with `shard_rank_and_size`.

`local_slices` says which rows/columns of each HF tensor a rank must read (so a loader reads
only those); `assemble_local` builds the shard from them; `merge_shards` turns the tp shards
back into full HF tensors. The three are inverse to each other (tested).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from stacx.models.architectures import DecoderShape
from stacx.parallel.groups import ProcessGroups

# (megatron name pattern, kind, HF name templates). `{i}` is the layer index.
_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"embedding\.word_embeddings\.weight", "vocab", ("model.embed_tokens.weight",)),
    (r"output_layer\.weight", "vocab", ("lm_head.weight",)),
    (r"decoder\.final_layernorm\.weight", "replicated", ("model.norm.weight",)),
    # local spec and transformer-engine spec (norm fused into the next linear) names
    (r"decoder\.layers\.(\d+)\.input_layernorm\.weight", "replicated", ("model.layers.{i}.input_layernorm.weight",)),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight", "replicated",
     ("model.layers.{i}.input_layernorm.weight",)),
    (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight", "replicated",
     ("model.layers.{i}.post_attention_layernorm.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight", "replicated",
     ("model.layers.{i}.post_attention_layernorm.weight",)),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight", "qkv",
     ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight")),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.bias", "qkv",
     ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
      "model.layers.{i}.self_attn.v_proj.bias")),
    (r"decoder\.layers\.(\d+)\.self_attention\.q_layernorm\.weight", "replicated",
     ("model.layers.{i}.self_attn.q_norm.weight",)),
    (r"decoder\.layers\.(\d+)\.self_attention\.k_layernorm\.weight", "replicated",
     ("model.layers.{i}.self_attn.k_norm.weight",)),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight", "row", ("model.layers.{i}.self_attn.o_proj.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight", "gate_up",
     ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight")),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.weight", "row", ("model.layers.{i}.mlp.down_proj.weight",)),
    # mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE); {e} is the global expert index
    (r"decoder\.layers\.(\d+)\.mlp\.router\.weight", "replicated", ("model.layers.{i}.mlp.gate.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight", "gate_up",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight")),
    (r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", "row",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc1\.weight", "gate_up",
     ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "model.layers.{i}.mlp.shared_expert.up_proj.weight")),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc2\.weight", "row",
     ("model.layers.{i}.mlp.shared_expert.down_proj.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.gate_weight", "replicated",
     ("model.layers.{i}.mlp.shared_expert_gate.weight",)),
)

ADAPTER_PARAMS = ("lora_a", "lora_b")
"""Names of a LoRA adapter's parameters on its linear (stacx.models.lora); they have no Hugging Face mapping of the
base model (`adapter_param_mappings` gives theirs)."""


def is_adapter_param_name(name: str) -> bool:
    """Whether a megatron parameter name is a LoRA adapter's (`...linear_qkv.lora_a`)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


# HF tensors a checkpoint may carry that have no megatron parameter (recomputed buffers).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Slice:
    """Read rows (dim 0) or columns (dim 1) [start, stop) of an HF tensor; dim None = the whole tensor."""

    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class ParamMapping:
    megatron_name: str
    kind: str
    hf_names: tuple[str, ...]
    local_shape: tuple[int, ...]
    routed_expert: bool = False
    """A routed expert's weight: sharded over the expert tensor-parallel group (etp), not tp."""

    def shard_rank_and_size(self, groups: ProcessGroups) -> tuple[int, int]:
        """(rank, size) of the group this parameter is sharded over: etp for routed experts, else tp."""
        return (groups.etp_rank, groups.etp_size) if self.routed_expert else (groups.tp_rank, groups.tp_size)

    def shard_group(self, groups: ProcessGroups):
        """The process group this parameter is sharded over (None for a size-1 axis)."""
        return groups.etp if self.routed_expert else groups.tp

    def hf_shapes(self, shape: DecoderShape, tp_size: int) -> tuple[tuple[int, ...], ...]:
        """The full HF shape of each of `hf_names`."""
        local, rest = self.local_shape, self.local_shape[1:]
        if self.kind == "replicated":
            return (local,)
        if self.kind == "row":
            return ((local[0], local[1] * tp_size),)
        if self.kind == "vocab":
            return ((shape.vocab_size, *rest),)
        if self.kind == "qkv":
            d = shape.head_dim
            return ((shape.num_attention_heads * d, *rest), (shape.num_kv_heads * d, *rest), (shape.num_kv_heads * d, *rest))
        if self.kind == "gate_up":
            full = (local[0] // 2 * tp_size, *rest)
            return (full, full)
        raise AssertionError(self.kind)

    def local_slices(self, shape: DecoderShape, tp_rank: int, tp_size: int) -> tuple[Slice, ...]:
        """Which part of each HF tensor TP rank `tp_rank` needs."""
        local = self.local_shape
        if self.kind == "replicated":
            return (Slice(),)
        if self.kind == "row":
            return (Slice(1, tp_rank * local[1], (tp_rank + 1) * local[1]),)
        if self.kind == "vocab":
            start = tp_rank * local[0]
            return (Slice(0, min(start, shape.vocab_size), min(start + local[0], shape.vocab_size)),)
        if self.kind == "qkv":
            d, groups_local = shape.head_dim, shape.num_kv_heads // tp_size
            q_per_group = shape.num_attention_heads // shape.num_kv_heads
            g0, g1 = tp_rank * groups_local, (tp_rank + 1) * groups_local
            kv = Slice(0, g0 * d, g1 * d)
            return (Slice(0, g0 * q_per_group * d, g1 * q_per_group * d), kv, kv)
        if self.kind == "gate_up":
            half = local[0] // 2
            part = Slice(0, tp_rank * half, (tp_rank + 1) * half)
            return (part, part)
        raise AssertionError(self.kind)

    def assemble_local(self, pieces: list[torch.Tensor], shape: DecoderShape, tp_size: int) -> torch.Tensor:
        """The megatron shard from the HF pieces read with `local_slices`."""
        if self.kind in ("replicated", "row"):
            return pieces[0]
        if self.kind == "vocab":
            piece = pieces[0]
            missing = self.local_shape[0] - piece.shape[0]  # vocab padding rows of the last shard
            return torch.cat([piece, piece.new_zeros(missing, *piece.shape[1:])]) if missing else piece
        if self.kind == "qkv":
            q, k, v = pieces
            groups_local, rest = shape.num_kv_heads // tp_size, q.shape[1:]
            per_group = [t.reshape(groups_local, -1, *rest) for t in (q, k, v)]
            return torch.cat(per_group, dim=1).reshape(-1, *rest)
        if self.kind == "gate_up":
            return torch.cat(pieces, dim=0)
        raise AssertionError(self.kind)

    def merge_shards(self, shards: list[torch.Tensor], shape: DecoderShape) -> list[torch.Tensor]:
        """Full HF tensors (in `hf_names` order) from every TP rank's shard, vocab padding stripped."""
        if self.kind == "replicated":
            return [shards[0]]
        if self.kind == "row":
            return [torch.cat(shards, dim=1)]
        if self.kind == "vocab":
            return [torch.cat(shards, dim=0)[: shape.vocab_size]]
        if self.kind == "qkv":
            d, tp_size = shape.head_dim, len(shards)
            groups_local = shape.num_kv_heads // tp_size
            q_rows = shape.num_attention_heads // shape.num_kv_heads * d
            qs, ks, vs = [], [], []
            for shard in shards:
                rest = shard.shape[1:]
                q, k, v = shard.reshape(groups_local, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
                qs.append(q.reshape(-1, *rest))
                ks.append(k.reshape(-1, *rest))
                vs.append(v.reshape(-1, *rest))
            return [torch.cat(qs), torch.cat(ks), torch.cat(vs)]
        if self.kind == "gate_up":
            halves = [shard.chunk(2, dim=0) for shard in shards]
            return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
        raise AssertionError(self.kind)


def _match(name: str, layer_offset: int = 0, first_local_expert: int = 0) -> tuple[str, tuple[str, ...], bool]:
    """(kind, HF names, routed expert?) of megatron parameter `name`: its layer index shifted by `layer_offset`
    (a pipeline stage's first layer), a routed expert's local index j mapped to Hugging Face expert
    `first_local_expert + j`."""
    for pattern, kind, templates in _RULES:
        found = re.fullmatch(pattern, name)
        if found:
            layer = int(found.group(1)) + layer_offset if found.groups() else None
            routed = len(found.groups()) == 2
            expert = first_local_expert + int(found.group(2)) if routed else None
            return kind, tuple(t.format(i=layer, e=expert) for t in templates), routed
    raise ValueError(f"megatron parameter {name!r} has no Hugging Face mapping in stacx.models.weight_mapping")


def layer_offset(gpt_model) -> int:
    """The global index of the model's first layer: 0, or where this pipeline stage's layers start
    (megatron numbers a stage's `decoder.layers.{i}` from 0 and keeps the global 1-based
    `layer_number` on each layer)."""
    layers = gpt_model.decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def holds_tied_head_copy(gpt_model) -> bool:
    """True on the last pipeline stage of a tied-embedding model: its `output_layer.weight` is a copy
    of the first stage's embedding (megatron keeps the two equal), which Hugging Face stores once."""
    return bool(getattr(gpt_model, "share_embeddings_and_output_weights", False)) and not gpt_model.pre_process


def _first_local_experts(gpt_model) -> dict[str, int]:
    """{MoE layer's module name: global index of its first local expert} (megatron's local_expert_indices)."""
    return {name: module.local_expert_indices[0] for name, module in gpt_model.named_modules()
            if getattr(module, "local_expert_indices", None)}


def param_mappings(gpt_model) -> list[ParamMapping]:
    """One mapping per parameter of an (unwrapped) megatron GPTModel, in parameter order.

    On a pipeline stage the layers map to their global Hugging Face indices; the tied LM-head copy
    on the last stage maps to `model.embed_tokens.weight`; routed experts to their global expert index.
    """
    offset = layer_offset(gpt_model)
    tied_copy = holds_tied_head_copy(gpt_model)
    first_experts = _first_local_experts(gpt_model)
    mappings = []
    for name, param in gpt_model.named_parameters():
        if is_adapter_param_name(name):
            continue  # LoRA adapters: stacx.models.lora.adapter_param_mappings
        layer_mlp = name.split(".experts.local_experts.")[0]
        kind, hf_names, routed = _match(name, offset, first_experts.get(layer_mlp, 0))
        if tied_copy and name == "output_layer.weight":
            hf_names = ("model.embed_tokens.weight",)
        mappings.append(ParamMapping(name, kind, hf_names, tuple(param.shape), routed))
    return mappings


def expected_param_mappings(shape: DecoderShape, tp_size: int, *, ep_size: int = 1, ep_rank: int = 0,
                            etp_size: int | None = None) -> list[ParamMapping]:
    """The mappings of the local-spec GPTModel `build_model` makes, computed from the config alone.

    Lets conversion tools work without building a model or process groups; a test checks it
    equals `param_mappings(build_model(...))` for every architecture and layout. `ep_rank`: which
    experts this rank holds; `etp_size` defaults to tp (megatron's default).
    """
    from stacx.models.architectures import padded_vocab_size

    hidden, d, ffn = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_kv_heads) * d // tp_size
    local_shapes: list[tuple[str, tuple[int, ...]]] = [
        ("embedding.word_embeddings.weight", (padded_vocab_size(shape.vocab_size, tp_size) // tp_size, hidden))
    ]
    for i in range(shape.num_layers):
        prefix = f"decoder.layers.{i}."
        local_shapes += [
            (prefix + "input_layernorm.weight", (hidden,)),
            # megatron registers linear_proj before linear_qkv; keep its parameter order.
            (prefix + "self_attention.linear_proj.weight", (hidden, shape.num_attention_heads * d // tp_size)),
            (prefix + "self_attention.linear_qkv.weight", (qkv_rows, hidden)),
        ]
        if shape.qkv_bias:
            local_shapes.append((prefix + "self_attention.linear_qkv.bias", (qkv_rows,)))
        if shape.architecture.qk_layernorm:
            local_shapes += [(prefix + "self_attention.q_layernorm.weight", (d,)),
                             (prefix + "self_attention.k_layernorm.weight", (d,))]
        local_shapes.append((prefix + "pre_mlp_layernorm.weight", (hidden,)))
        if shape.moe is None:
            local_shapes += [
                (prefix + "mlp.linear_fc1.weight", (2 * ffn // tp_size, hidden)),
                (prefix + "mlp.linear_fc2.weight", (hidden, ffn // tp_size)),
            ]
        else:
            local_shapes += _moe_local_shapes(shape, prefix + "mlp.", tp_size, ep_size, etp_size or tp_size)
    local_shapes.append(("decoder.final_layernorm.weight", (hidden,)))
    if not shape.tie_word_embeddings:
        local_shapes.append(("output_layer.weight", local_shapes[0][1]))
    first_expert = ep_rank * (shape.moe.num_experts // ep_size) if shape.moe is not None else 0
    mappings = []
    for name, local_shape in local_shapes:
        kind, hf_names, routed = _match(name, first_local_expert=first_expert)
        mappings.append(ParamMapping(name, kind, hf_names, local_shape, routed))
    return mappings


def _moe_local_shapes(shape: DecoderShape, prefix: str, tp_size: int, ep_size: int, etp_size: int):
    """(name, local shape) of one MoE layer's parameters, in megatron's registration order."""
    moe, hidden = shape.moe, shape.hidden_size
    expert_ffn = moe.expert_ffn_hidden_size // etp_size
    local_shapes = [(prefix + "router.weight", (moe.num_experts, hidden))]
    for j in range(moe.num_experts // ep_size):
        local_shapes += [(prefix + f"experts.local_experts.{j}.linear_fc1.weight", (2 * expert_ffn, hidden)),
                         (prefix + f"experts.local_experts.{j}.linear_fc2.weight", (hidden, expert_ffn))]
    if moe.shared_expert_ffn_hidden_size:
        shared_ffn = moe.shared_expert_ffn_hidden_size // tp_size
        local_shapes += [(prefix + "shared_experts.gate_weight", (1, hidden)),
                         (prefix + "shared_experts.linear_fc1.weight", (2 * shared_ffn, hidden)),
                         (prefix + "shared_experts.linear_fc2.weight", (hidden, shared_ffn))]
    return local_shapes
