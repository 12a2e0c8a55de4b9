"""A tiny randomly initialized Hugging Face checkpoint with a character tokenizer for a task.

    write_tiny_checkpoint("outputs/demo/init", "sorting", hidden_size=64, num_layers=2)

The folder holds config.json, model.safetensors and the tokenizer files, so every part of
Stacx that takes `--hf-checkpoint` (trainer, `stacx serve`, the CPU engine) loads it. The
vocabulary is the tokenizer's specials (<pad>=0, <eos>=1, ...) plus one token per character of
the task's alphabet: 17 tokens for `sorting`.
"""

from __future__ import annotations

import os

from stacx.tasks.builtin import get_task


def write_tiny_checkpoint(out_dir: str, task_name: str, *, hidden_size: int = 64, num_layers: int = 2,
                          num_attention_heads: int = 4, ffn_hidden_size: int | None = None,
                          max_position_embeddings: int = 64, seed: int = 0) -> str:
    """Write a random Llama-style decoder sized for `task_name`; returns `out_dir`.

    Weights: transformers' default init (normal, std 0.02) under `torch.manual_seed(seed)`.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stacx.rollout.tokenizer import build_char_tokenizer

    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_attention_heads {num_attention_heads}")
    task = get_task(task_name)
    tokenizer = build_char_tokenizer(task.alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=ffn_hidden_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
