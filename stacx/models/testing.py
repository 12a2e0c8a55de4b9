"""Tiny random Hugging Face decoders for tests and demos, built from configs (nothing downloaded).

    config = tiny_hf_config("qwen3", vocab_size=100)
    save_tiny_hf_checkpoint(folder, "llama", seed=0)   # config.json + model.safetensors
"""

from __future__ import annotations

import torch

_TINY_DEFAULTS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_hf_config(arch: str = "llama", vocab_size: int = 101, **overrides):
    """A `transformers` config of a tiny `arch` decoder ("llama", "qwen2", "qwen3"; "qwen2_moe" and "qwen3_moe":
    4 experts, top-2 routing, and for Qwen2-MoE a shared expert).

    The default vocab (101) is odd on purpose, so TP=2 needs vocab padding. Any config field
    can be overridden (e.g. tie_word_embeddings=True, rope_parameters={...}).
    """
    from transformers import AutoConfig

    from stacx.models.architectures import ARCHITECTURES

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; supported: {sorted(ARCHITECTURES)}")
    fields = dict(_TINY_DEFAULTS, vocab_size=vocab_size)
    if arch in ("qwen3", "qwen3_moe"):
        fields["head_dim"] = 16
    if ARCHITECTURES[arch].mixture_of_experts:
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if ARCHITECTURES[arch].shared_expert:
        fields["shared_expert_intermediate_size"] = 48
    fields.update(overrides)
    return AutoConfig.for_model(arch, **fields)


def build_tiny_hf_model(config, seed: int):
    """A randomly initialized `transformers` causal LM for `config`, fp32, eval mode.

    Norm weights are randomized too (HF initializes them to ones), so a wrong mapping of a norm
    cannot hide.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model.eval()


def save_tiny_hf_checkpoint(directory, arch: str = "llama", seed: int = 0, **config_overrides):
    """Write a random tiny `arch` checkpoint (config.json + safetensors) to `directory`; return the config."""
    config = tiny_hf_config(arch, **config_overrides)
    model = build_tiny_hf_model(config, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return config
