"""Stacx's packed core attention (single process) against a float64 per-sequence reference."""

import math

import torch

from stacx.models.packed_attention import packed_causal_attention


def _reference(q, k, v):
    """Plain causal softmax attention of one sequence in float64, GQA by repeating KV heads."""
    q, k, v = (t.double() for t in (q, k, v))  # [L, H, D]
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    length = q.shape[0]
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_packed_gqa_attention_never_crosses_sequences():
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 4]
    total = sum(lengths)
    q = torch.randn(total, 4, 8, generator=generator)
    k = torch.randn(total, 2, 8, generator=generator)
    v = torch.randn(total, 2, 8, generator=generator)
    out = packed_causal_attention(q, k, v, lengths, None, 1 / math.sqrt(8))
    want = torch.cat([_reference(*parts) for parts in zip(q.split(lengths), k.split(lengths), v.split(lengths))])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    # Changing another sequence's keys leaves sequence 0's output untouched.
    k2 = k.clone()
    k2[5:] += 1.0
    assert torch.equal(packed_causal_attention(q, k2, v, lengths, None, 1 / math.sqrt(8))[:5], out[:5])
