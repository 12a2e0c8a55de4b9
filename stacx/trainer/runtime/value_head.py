"""A scalar value head for critic roles, put where megatron's GPTModel has its language-model head.

A critic is the same decoder as the policy with `output_layer` ([hidden] -> [vocab/tp] logits)
replaced by `ValueHead` ([hidden] -> [1]). GPTModel calls its output layer as
`output_layer(hidden_states, weight=..., runtime_gather_output=...)` and expects a
`(output, bias)` pair, so the head keeps that call signature. The head is replicated on every TP
rank: its input (the final hidden states, no sequence parallelism) is identical on all of them,
so are its gradients, and megatron's grad-norm counts a parameter without the
`tensor_model_parallel` attribute once.
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    """values [s, b, 1] = hidden [s, b, h] @ w [1, h]^T + b; zero-initialized (V = 0 at the start)."""

    sequence_parallel = False  # read by GPTModel for inference-time logits slicing

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        # `weight` is the tied embedding GPTModel passes for a shared LM head; a value head ignores it.
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        return values, None


def attach_value_head(model) -> ValueHead:
    """Replace the GPTModel's language-model head with a ValueHead (call after loading HF weights)."""
    # Imported here: megatron-core is slow to import (start-up time).
    from stacx.models import unwrap_model

    gpt = unwrap_model(model)
    head = ValueHead(gpt.config.hidden_size, dtype=gpt.config.params_dtype).to(next(gpt.parameters()).device)
    gpt.output_layer = head
    # A tied LM head would make GPTModel fetch the embedding as the output weight; the head ignores it,
    # but the flag also makes megatron all-reduce embedding grads with the head's: turn it off.
    gpt.share_embeddings_and_output_weights = False
    return head
