"""Shared cases for the model parity tests: tiny checkpoints, packed batches, and the HF reference."""

from __future__ import annotations

import torch

from stacx.models.testing import build_tiny_hf_model, tiny_hf_config

# Llama with Llama 3 rope scaling whose band edges fall inside head_dim 16's frequencies
# (original_max 64: one frequency kept, one interpolated, the rest divided by `factor`).
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}

ARCH_CASES = {
    "llama": dict(arch="llama", rope_parameters=LLAMA3_ROPE, head_dim=16),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", tie_word_embeddings=True),
}

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, cp)

# Varied lengths: odd ones need CP padding, one is shorter than 2*cp chunks would suggest.
PACKED_LENGTHS = [7, 13, 3, 10]


def case_config(name: str):
    fields = dict(ARCH_CASES[name])
    return tiny_hf_config(fields.pop("arch"), **fields)


def save_case_checkpoint(name: str, folder: str, seed: int = 0):
    config = case_config(name)
    model = build_tiny_hf_model(config, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return config, model


def packed_tokens(vocab_size: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (sum(PACKED_LENGTHS),), generator=generator)


def logit_weights(vocab_size: int, seed: int = 2) -> torch.Tensor:
    """A fixed random [T_real, V] weight defining the scalar loss sum(logits * W) for gradient checks."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(PACKED_LENGTHS), vocab_size, generator=generator, dtype=torch.float32)


def hf_reference(model, tokens: torch.Tensor, weights: torch.Tensor):
    """HF logits [T_real, V] (each sequence run alone) and grads of sum(logits * W) by HF name."""
    model.zero_grad()
    logits = torch.cat([model(seq[None]).logits[0] for seq in tokens.split(PACKED_LENGTHS)])
    (logits * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), grads
