"""Which Hugging Face decoder families Stacx builds, and how their config fields map to megatron-core.

An architecture is a row in `ARCHITECTURES`: its `model_type`, the HF class name, and the
per-family switches (q/k/v bias, qk RMSNorm). Everything else (sizes, eps, rope, tied
embeddings) is read from the config the same way for every family. Adding a family is adding a
row here plus, if its weights are named differently, a rule in `weight_mapping.py`
(see docs/models.md).
"""

from __future__ import annotations

import json
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


ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture(model_type="llama", hf_class_name="LlamaForCausalLM", qkv_bias_default=False, qk_layernorm=False),
        Architecture(model_type="qwen2", hf_class_name="Qwen2ForCausalLM", qkv_bias_default=True, qk_layernorm=False),
        Architecture(model_type="qwen3", hf_class_name="Qwen3ForCausalLM", qkv_bias_default=False, qk_layernorm=True),
    )
}


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


def load_hf_config(hf_config):
    """A `transformers.PretrainedConfig` from a config object, a dict, a folder or a config.json path."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, Mapping):
        fields = dict(hf_config)
        model_type = fields.pop("model_type", None)
        _require_supported(model_type, "hf_config['model_type']")
        return AutoConfig.for_model(model_type, **fields)
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"Hugging Face config not found: {config_path}")
        with open(config_path) as f:
            fields = json.load(f)
        model_type = fields.pop("model_type", None)
        _require_supported(model_type, f"model_type in {config_path}")
        return AutoConfig.for_model(model_type, **fields)
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
    )


def check_tensor_parallel_size(shape: DecoderShape, tp_size: int) -> None:
    """Raise naming the field when tp does not divide the heads, KV heads or FFN width."""
    for field, value in (
        ("num_attention_heads", shape.num_attention_heads),
        ("num_key_value_heads", shape.num_kv_heads),
        ("intermediate_size", shape.ffn_hidden_size),
    ):
        if value % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide {field}={value}")


def check_pipeline_parallel_size(shape: DecoderShape, pp_size: int) -> None:
    """Raise naming the flag when pp does not divide the layers (every stage holds as many)."""
    if shape.num_layers % pp_size:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp_size} does not divide num_hidden_layers={shape.num_layers}: "
            f"each pipeline stage holds the same number of layers; pick a divisor of {shape.num_layers}"
        )


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocab rounded up to a multiple of tp (the smallest padding that shards evenly)."""
    return -(-vocab_size // tp_size) * tp_size
