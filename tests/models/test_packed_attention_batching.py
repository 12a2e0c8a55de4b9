"""Packed attention calls attention once per distinct padded length (a batch of the sequences of that
length), and the result is the one-call-per-sequence result bit for bit, outputs and gradients."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from stacx.models import packed_attention
from stacx.models.packed_attention import packed_causal_attention


def _one_call_per_sequence(query, key, value, lengths, scale):
    """The per-sequence computation (what packed attention did before it batched equal lengths)."""
    outputs = []
    for length, q, k, v in zip(lengths, query.split(lengths), key.split(lengths), value.split(lengths)):
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        allowed = torch.arange(length)[:, None] >= torch.arange(length)[None, :]
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                      enable_gqa=q.shape[0] != k.shape[0]).transpose(0, 1))
    return torch.cat(outputs)


def _output_and_grads(attention, tensors, lengths):
    tensors = [t.clone().requires_grad_(True) for t in tensors]
    out = attention(*tensors, lengths, 1 / math.sqrt(tensors[0].shape[-1]))
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach()] + [t.grad for t in tensors]


def test_sequences_of_one_length_share_one_attention_call_and_the_result_is_unchanged_bit_for_bit(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    lengths = [14, 8, 14, 14, 16, 8, 14, 1] * 8  # 64 sequences, 4 lengths, interleaved
    total = sum(lengths)
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [torch.randn(total, heads, 8, generator=generator).to(dtype) for heads in (4, 2, 2)]  # GQA
        calls = []
        real = F.scaled_dot_product_attention
        monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention",
                            lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
        batched = _output_and_grads(lambda *a: packed_causal_attention(*a[:4], None, a[4]), tensors, lengths)
        monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", real)
        assert len(calls) == 4
        per_sequence = _output_and_grads(_one_call_per_sequence, tensors, lengths)
        for got, want in zip(batched, per_sequence):
            assert torch.equal(got, want)
