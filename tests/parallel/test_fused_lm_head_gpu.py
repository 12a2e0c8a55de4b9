"""GPU tier: the fused LM-head log-probs on CUDA against the unfused path (logits = h W^T, then the
vocab-parallel log-probs), at a shape where the logits would be large, with the default tiles.

Run on a CUDA machine with:  python -m pytest -m gpu tests/parallel/test_fused_lm_head_gpu.py
The CPU tests of the same kernels: tests/parallel/test_fused_lm_head_logprobs.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_fused_lm_head_logprobs import NAMES, fused_results, relative_error, unfused_results

#: fp32 on CUDA: TF32 is off below, so the kernels agree as on CPU (the CPU tests' 1e-5).
FP32_RELATIVE_TOLERANCE = 1e-5
#: bf16 inputs: the tiles' matmuls round differently from one full matmul.
BF16_RELATIVE_TOLERANCE = 2e-2


def _cuda_problem(num_tokens: int, hidden_size: int, vocab: int, k: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, device="cuda").to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device="cuda") * 0.05).to(dtype)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen, device="cuda")
    ids = torch.randint(0, vocab, (num_tokens, k), generator=gen, device="cuda")
    grads = [torch.randn(num_tokens, generator=gen, device="cuda"), torch.randn(num_tokens, generator=gen, device="cuda"),
             torch.randn(num_tokens, k, generator=gen, device="cuda")]
    return hidden, weight, targets, ids, *grads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, FP32_RELATIVE_TOLERANCE),
                                              (torch.bfloat16, BF16_RELATIVE_TOLERANCE)])
def test_fused_lm_head_on_cuda_matches_the_unfused_path_and_never_holds_the_logits(dtype, tolerance):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (marked gpu); run on a GPU machine with: pytest -m gpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    num_tokens, hidden_size, vocab = 4096, 1024, 32768
    problem = _cuda_problem(num_tokens, hidden_size, vocab, k=4, dtype=dtype)
    expected = unfused_results(*problem, temperature=0.7)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = fused_results(*problem, temperature=0.7, tile=(None, None), tp_group=None)
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - before
    for name, ours, ref in zip(NAMES, got, expected):
        assert ours.is_cuda and torch.isfinite(ours).all(), name
        assert relative_error(ours.float(), ref.float()) <= tolerance, name
    # The fused path keeps tiles, not the [T, V] logits (nor their fp32 softmax), on the device.
    logits_bytes = num_tokens * vocab * torch.finfo(dtype).bits // 8
    assert peak_extra < logits_bytes, (peak_extra, logits_bytes)
