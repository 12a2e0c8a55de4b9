"""Which Hugging Face decoder families Stacx builds, and how their config fields map to megatron-core.

An architecture is a row in `ARCHITECTURES`: its `model_type`, the HF class name, and the
per-family switches (q/k/v bias, qk RMSNorm). Everything else (sizes, eps, rope, tied
embeddings) is read from the config the same way for every family. Adding a family is adding a
row here plus, if its weights are named differently, a rule in `weight_mapping.py`
(see docs/models.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One supported Hugging Face decoder family."""

    model_type: str
    """The config's `model_type` ("llama", "qwen2", "qwen3")."""
    hf_class_name: str
    """The `architectures[0]` entry written on export (e.g. "LlamaForCausalLM")."""
    qkv_bias_default: bool
    """Whether q/k/v projections carry a bias when the config has no `attention_bias` field."""
    qk_layernorm: bool
    """Whether each head's query and key pass through an RMSNorm before RoPE (Qwen3)."""
    mixture_of_experts: bool = False
    """Whether every layer's MLP is a routed mixture of experts (`num_experts`, `num_experts_per_tok`)."""
    shared_expert: bool = False
    """Whether each MoE layer adds a sigmoid-gated shared expert (Qwen2-MoE's `shared_expert_intermediate_size`)."""


ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture(model_type="llama", hf_class_name="LlamaForCausalLM", qkv_bias_default=False, qk_layernorm=False),
        Architecture(model_type="qwen2", hf_class_name="Qwen2ForCausalLM", qkv_bias_default=True, qk_layernorm=False),
        Architecture(model_type="qwen3", hf_class_name="Qwen3ForCausalLM", qkv_bias_default=False, qk_layernorm=True),
        Architecture(model_type="qwen2_moe", hf_class_name="Qwen2MoeForCausalLM", qkv_bias_default=True,
                     qk_layernorm=False, mixture_of_experts=True, shared_expert=True),
        Architecture(model_type="qwen3_moe", hf_class_name="Qwen3MoeForCausalLM", qkv_bias_default=False,
                     qk_layernorm=True, mixture_of_experts=True),
    )
}


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """The mixture-of-experts part of a decoder (every layer's MLP is one), read from a Hugging Face config."""

    num_experts: int
    """Routed experts per layer (`num_experts`)."""
    top_k: int
    """Experts each token is sent to (`num_experts_per_tok`)."""
    expert_ffn_hidden_size: int
    """Each routed expert's SwiGLU width (`moe_intermediate_size`)."""
    shared_expert_ffn_hidden_size: int
    """The shared expert's width (`shared_expert_intermediate_size`); 0 when the family has none."""
    normalize_top_k: bool
    """`norm_topk_prob`: the top-k routing weights are renormalized to sum to 1 (else they are the
    softmax over all experts, restricted to the top k)."""


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The architecture-independent description of a decoder, read from a Hugging Face config."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    """The llama3 rope-scaling parameters (factor, low/high_freq_factor, original_max_position_embeddings), or None."""
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    moe: MoEShape | None = None
    """The mixture-of-experts sizes, or None for a dense decoder."""


def load_hf_config(hf_config):
    """The config of a model: a `HuggingFaceConfig` (read without `transformers`, see `hf_config.py`) from a
    dict, a folder or a config.json path; a `transformers.PretrainedConfig` or a `HuggingFaceConfig` as given."""
    from stacx.models.hf_config import HuggingFaceConfig, read_hf_config

    if isinstance(hf_config, Mapping):
        _require_supported(hf_config.get("model_type"), "hf_config['model_type']")
        return HuggingFaceConfig(hf_config)
    if isinstance(hf_config, (str, os.PathLike)):
        return read_hf_config(hf_config)
    if isinstance(hf_config, HuggingFaceConfig) or hasattr(hf_config, "to_diff_dict"):
        return hf_config
    raise TypeError(f"hf_config must be a PretrainedConfig, a dict or a path, got {type(hf_config).__name__}")


def _require_supported(model_type, where: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({where}); supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]


def _rope_fields(config) -> tuple[float, Mapping[str, Any] | None]:
    """(rope_theta, llama3 scaling or None) from either the transformers 4 or 5 config layout."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        if missing:
            raise ValueError(f"rope scaling 'llama3' is missing fields {missing}")
        return float(theta), {k: params[k] for k in keys}
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: ['default', 'llama3']")


def decoder_shape(config) -> DecoderShape:
    """Validate a Hugging Face config and read the fields the builder and the weight mapping need."""
    arch = _require_supported(getattr(config, "model_type", None), "config.model_type")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' (SwiGLU)")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported; sliding-window attention is not implemented")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    theta, scaling = _rope_fields(config)
    qkv_bias = getattr(config, "attention_bias", None)
    if qkv_bias and not arch.qkv_bias_default:
        # Llama/Qwen3's attention_bias also adds an o_proj bias, which megatron's layer lacks.
        raise ValueError(f"attention_bias=True is not supported for {arch.model_type!r}")
    return DecoderShape(
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        ffn_hidden_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=arch.qkv_bias_default if qkv_bias is None else bool(qkv_bias),
        max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
        moe=_moe_shape(config) if arch.mixture_of_experts else None,
    )


def _moe_shape(config) -> MoEShape:
    """Validate the MoE fields of a config; only decoders whose every layer is an MoE layer are built."""
    sparse_step = getattr(config, "decoder_sparse_step", 1)
    dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ValueError(
            f"{config.model_type}: decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers} mix dense and "
            "MoE layers, which is not supported; every layer must be an MoE layer (decoder_sparse_step=1, "
            "mlp_only_layers=[])")
    num_experts, top_k = int(config.num_experts), int(config.num_experts_per_tok)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    arch = ARCHITECTURES[config.model_type]
    return MoEShape(
        num_experts=num_experts,
        top_k=top_k,
        expert_ffn_hidden_size=int(config.moe_intermediate_size),
        shared_expert_ffn_hidden_size=int(config.shared_expert_intermediate_size) if arch.shared_expert else 0,
        normalize_top_k=bool(getattr(config, "norm_topk_prob", False)),
    )


def check_tensor_parallel_size(shape: DecoderShape, tp_size: int) -> None:
    """Raise naming the field when tp does not divide the heads, KV heads or FFN width."""
    fields = [("num_attention_heads", shape.num_attention_heads), ("num_key_value_heads", shape.num_kv_heads)]
    if shape.moe is None:
        fields.append(("intermediate_size", shape.ffn_hidden_size))
    elif shape.moe.shared_expert_ffn_hidden_size:
        fields.append(("shared_expert_intermediate_size", shape.moe.shared_expert_ffn_hidden_size))
    for field, value in fields:
        if value % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} (--tensor-model-parallel-size) does not divide "
                             f"{field}={value}")


def check_expert_parallel_sizes(shape: DecoderShape, ep_size: int, etp_size: int) -> None:
    """Raise naming the flag and the config field when ep does not divide the experts or etp their width.

    A dense decoder accepts only ep = 1 (there are no experts to spread)."""
    if shape.moe is None:
        if ep_size != 1:
            raise ValueError(f"--expert-model-parallel-size {ep_size} needs a mixture-of-experts model; "
                             f"{shape.architecture.model_type!r} is dense (use 1)")
        return
    if shape.moe.num_experts % ep_size:
        raise ValueError(f"--expert-model-parallel-size {ep_size} does not divide num_experts={shape.moe.num_experts}; "
                         "choose a divisor of the number of experts")
    if shape.moe.expert_ffn_hidden_size % etp_size:
        raise ValueError(f"--expert-tensor-parallel-size {etp_size} does not divide "
                         f"moe_intermediate_size={shape.moe.expert_ffn_hidden_size}")


def check_pipeline_parallel_size(shape: DecoderShape, pp_size: int, vp_size: int = 1) -> None:
    """Raise naming the flags when pp x vp does not divide the layers (every stage, virtual or not, holds as many)."""
    if shape.num_layers % pp_size:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp_size} does not divide num_hidden_layers={shape.num_layers}: "
            f"each pipeline stage holds the same number of layers; pick a divisor of {shape.num_layers}"
        )
    if shape.num_layers % (pp_size * vp_size):
        raise ValueError(
            f"--pipeline-model-parallel-size {pp_size} x {vp_size} virtual stages does not divide "
            f"num_hidden_layers={shape.num_layers}: pick --num-layers-per-virtual-pipeline-stage dividing "
            f"{shape.num_layers // pp_size}")


def num_virtual_stages(num_layers: int, pp_size: int, layers_per_virtual_stage: int | None) -> int:
    """Model chunks per pipeline rank for --num-layers-per-virtual-pipeline-stage: L / (pp x that), 1 when unset."""
    if layers_per_virtual_stage is None:
        return 1
    if pp_size == 1:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} needs "
                         "--pipeline-model-parallel-size > 1 (interleaving splits each rank's pipeline stage)")
    per_rank = num_layers // pp_size
    if layers_per_virtual_stage < 1 or num_layers % pp_size or per_rank % layers_per_virtual_stage:
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} does not divide the "
                         f"{per_rank} layers of each of the --pipeline-model-parallel-size {pp_size} stages "
                         f"(num_hidden_layers={num_layers}); use one of {divisors}")
    return per_rank // layers_per_virtual_stage


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocab rounded up to a multiple of tp (the smallest padding that shards evenly)."""
    return -(-vocab_size // tp_size) * tp_size
