"""A tiny randomly initialized Hugging Face checkpoint with a character tokenizer for a task.

    write_tiny_checkpoint("outputs/demo/init", "sorting", hidden_size=64, num_layers=2)

    write_tiny_tool_checkpoint("tiny-agent", style="qwen")     # chat template with tools: agents, --agent-command
    write_tiny_moe_checkpoint("tiny-moe", num_experts=4)        # Qwen3-MoE: --expert-model-parallel-size

The folder holds config.json, model.safetensors and the tokenizer files, so every part of
Stacx that takes `--hf-checkpoint` (trainer, `stacx serve`, the CPU engine) loads it. The
vocabulary is the tokenizer's specials (<pad>=0, <eos>=1, ...) plus one token per character of
the task's alphabet: 17 tokens for `sorting`. The tool checkpoint's tokenizer is a character
tokenizer with a tool-calling chat template (stacx.rollout.agents.chat_tokenizers: `qwen`, `qwen_compact`,
`llama3`), the one the agent demo uses.
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
    from stacx.rollout.tokenizer import build_char_tokenizer

    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_attention_heads {num_attention_heads}")
    tokenizer = build_char_tokenizer(get_task(task_name).alphabet)
    return _write_random_model(out_dir, "llama", tokenizer, seed, hidden_size=hidden_size,
                               intermediate_size=ffn_hidden_size or 2 * hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
                               max_position_embeddings=max_position_embeddings)


def write_tiny_tool_checkpoint(out_dir: str, *, style: str = "qwen", hidden_size: int = 64, num_layers: int = 2,
                               max_position_embeddings: int = 2048, seed: int = 0) -> str:
    """Write a random Llama-style decoder whose tokenizer has a tool-calling chat template (`style`: `qwen`,
    `qwen_compact` or `llama3`; the Hermes `<tool_call>{json}</tool_call>` protocol or Llama 3's), for agent
    episodes, `stacx serve`'s OpenAI endpoint and `--agent-command`; returns `out_dir`."""
    from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer

    heads = max(1, hidden_size // 16)
    return _write_random_model(out_dir, "llama", build_tool_chat_tokenizer(style), seed, hidden_size=hidden_size,
                               intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=heads, num_key_value_heads=heads,
                               max_position_embeddings=max_position_embeddings)


def write_tiny_moe_checkpoint(out_dir: str, task_name: str = "sorting", *, num_experts: int = 4,
                              num_experts_per_tok: int = 2, hidden_size: int = 64, num_layers: int = 2,
                              max_position_embeddings: int = 256, seed: int = 0, head_dim: int = 16) -> str:
    """Write a random Qwen3-MoE decoder (`num_experts` routed experts, top-`num_experts_per_tok`) with the
    character tokenizer of `task_name`, for mixture-of-experts runs (`--expert-model-parallel-size`,
    `--use-routing-replay`); returns `out_dir`. `head_dim`: hidden_size // head_dim heads of it (vLLM's CPU
    attention takes head sizes from 32 up: `head_dim=32` for a model vLLM serves on CPU)."""
    from stacx.rollout.tokenizer import build_char_tokenizer

    if head_dim <= 0 or hidden_size % head_dim:
        raise ValueError(f"head_dim {head_dim} must be a positive divisor of hidden_size {hidden_size}")
    heads = hidden_size // head_dim
    return _write_random_model(out_dir, "qwen3_moe", build_char_tokenizer(get_task(task_name).alphabet), seed,
                               hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                               num_key_value_heads=heads, head_dim=head_dim, num_experts=num_experts,
                               num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=hidden_size // 2,
                               intermediate_size=2 * hidden_size, max_position_embeddings=max_position_embeddings)


def _write_random_model(out_dir: str, model_type: str, tokenizer, seed: int, **fields) -> str:
    """config.json + model.safetensors (transformers' default init under `torch.manual_seed(seed)`) + the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=None, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
