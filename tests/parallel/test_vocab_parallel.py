"""Vocab-parallel log-probs, entropy, log-probs at ids and top-k against float64 full-vocab references."""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from stacx.parallel.vocab_parallel_topk import vocab_parallel_log_probs_at_ids, vocab_parallel_topk
from stacx.testing.distributed import run_distributed
from tests.parallel.collective_counter import install_collective_counter

# fp32 math against float64 references on O(1)-scaled logits.
ATOL = 2e-5


def make_problem(num_tokens=23, vocab=40, k=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    ids = torch.randint(0, vocab, (num_tokens, k), generator=gen)
    ids[:, 1] = ids[:, 0]  # duplicate ids must accumulate gradients
    grad_lp = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    grad_h = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    grad_ids = torch.randn(num_tokens, k, generator=gen, dtype=torch.float64)
    return logits, targets, ids, grad_lp, grad_h, grad_ids


def reference(logits, targets, ids, grad_lp, grad_h, grad_ids, temperature):
    """Full-vocab float64 log-probs, entropy, log-probs at ids, and d(objective)/d(logits)."""
    z = logits.clone().requires_grad_()
    log_softmax = torch.log_softmax(z / temperature, dim=-1)
    log_probs = log_softmax.gather(1, targets[:, None])[:, 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    at_ids = log_softmax.gather(1, ids)
    objective = (log_probs * grad_lp).sum() + (entropy * grad_h).sum() + (at_ids * grad_ids).sum()
    (grad,) = torch.autograd.grad(objective, z)
    return log_probs.detach(), entropy.detach(), at_ids.detach(), grad


def sharded_results(logits_shard, targets, ids, grad_lp, grad_h, grad_ids, temperature, chunk_tokens, tp_group):
    """Our outputs and the same objective's gradient w.r.t. this shard."""
    z = logits_shard.float().clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        z, targets, tp_group=tp_group, temperature=temperature, chunk_tokens=chunk_tokens
    )
    at_ids, _ = vocab_parallel_log_probs_at_ids(
        z, ids, tp_group=tp_group, temperature=temperature, chunk_tokens=chunk_tokens
    )
    objective = (log_probs * grad_lp.float()).sum() + (entropy * grad_h.float()).sum() + (at_ids * grad_ids.float()).sum()
    objective.backward()
    return log_probs.detach(), entropy.detach(), at_ids.detach(), z.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [None, 4, 1000])
def test_single_shard_matches_full_vocab_reference(temperature, chunk_tokens):
    problem = make_problem()
    expected = reference(*problem, temperature)
    got = sharded_results(*problem, temperature, chunk_tokens, None)
    for name, ours, ref in zip(("log_probs", "entropy", "log_probs_at_ids", "grad"), got, expected):
        torch.testing.assert_close(ours.double(), ref, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")


def test_bf16_logits_give_bf16_gradient_close_to_reference():
    logits, targets, *_ = make_problem()
    z = logits.to(torch.bfloat16).requires_grad_()
    log_probs = vocab_parallel_log_probs(z, targets, chunk_tokens=5)
    log_probs.sum().backward()
    z_ref = z.detach().double().requires_grad_()
    torch.log_softmax(z_ref, -1).gather(1, targets[:, None]).sum().backward()
    assert z.grad.dtype == torch.bfloat16 and log_probs.dtype == torch.float32
    torch.testing.assert_close(z.grad.double(), z_ref.grad, atol=1e-2, rtol=0)


def saved_by_vocab_parallel_node(output):
    """Non-None tensors saved by the vocab-parallel autograd node behind `output`."""
    pending = [output.grad_fn]
    while pending:
        node = pending.pop()
        if "VocabParallelLogProbs" in type(node).__name__:
            return [t for t in node.saved_tensors if t is not None]
        pending.extend(fn for fn, _ in node.next_functions if fn is not None)
    raise AssertionError("no vocab-parallel node in the graph")


def test_entropy_without_grad_keeps_no_entropy_state_and_is_detached():
    logits, targets, *_ = make_problem()
    z = logits.float().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(z, targets, entropy_requires_grad=False)
    assert not entropy.requires_grad
    # logits, local ids, owned mask, lse: no entropy tensor.
    assert len(saved_by_vocab_parallel_node(log_probs)) == 4
    _, entropy_with_grad = vocab_parallel_log_probs_and_entropy(z, targets, entropy_requires_grad=True)
    assert entropy_with_grad.requires_grad
    assert len(saved_by_vocab_parallel_node(entropy_with_grad)) == 5
    torch.testing.assert_close(entropy, entropy_with_grad.detach())
    torch.testing.assert_close(vocab_parallel_entropy(z).detach(), entropy)


def test_extra_memory_is_bounded_by_the_chunk_not_the_batch():
    """Largest single allocation during forward+backward: the gradient itself, then chunk-sized temporaries."""
    from torch.profiler import ProfilerActivity, profile

    num_tokens, vocab, chunk = 256, 4096, 8
    z = torch.randn(num_tokens, vocab).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(z, targets, chunk_tokens=chunk)
        (log_probs.sum() + entropy.sum()).backward()
    sizes = sorted((e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), reverse=True)
    shard_bytes = z.numel() * 4
    chunk_bytes = chunk * vocab * 4
    assert sizes[0] == shard_bytes  # the gradient of the logits
    assert sizes[1] <= chunk_bytes  # nothing else bigger than one fp32 chunk


def test_bad_ids_and_shapes_raise_clear_errors():
    z = torch.randn(4, 10)
    with pytest.raises(ValueError, match="vocab_size=10"):
        vocab_parallel_log_probs(z, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="shape"):
        vocab_parallel_log_probs_at_ids(z, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(z, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="k must be"):
        vocab_parallel_topk(z, 11)


def test_topk_single_shard_matches_torch_topk():
    logits, *_ = make_problem()
    values, ids = vocab_parallel_topk(logits.float(), 7, temperature=0.5)
    ref_values, ref_ids = (logits.float() / 0.5).topk(7, dim=-1)
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(ids, ref_ids)


# ---- TP = 2 over gloo (one spawn for everything) ----------------------------------------------


def _tp2_checks(groups):

    counts = install_collective_counter()

    tp, rank = groups.tp_size, groups.tp_rank
    errors = {}
    logits, targets, ids, grad_lp, grad_h, grad_ids = make_problem(num_tokens=19, vocab=48, k=6, seed=3)
    vocab_local = logits.shape[1] // tp
    shard = logits[:, rank * vocab_local : (rank + 1) * vocab_local]
    for temperature in (1.0, 0.8):
        expected = reference(logits, targets, ids, grad_lp, grad_h, grad_ids, temperature)
        for chunk in (None, 3):
            got = sharded_results(shard, targets, ids, grad_lp, grad_h, grad_ids, temperature, chunk, groups.tp)
            expected_local = expected[:3] + (expected[3][:, rank * vocab_local : (rank + 1) * vocab_local],)
            for name, ours, ref in zip(("log_probs", "entropy", "at_ids", "grad"), got, expected_local):
                errors[f"{name}/T={temperature}/chunk={chunk}"] = float((ours.double() - ref).abs().max())

    # Collectives: log-probs+entropy forward = 1 all-gather; backward = none.
    for name in counts:
        counts[name] = 0
    z = shard.float().clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(z, targets, tp_group=groups.tp, chunk_tokens=4)
    forward_counts = dict(counts)
    (log_probs.sum() + entropy.sum()).backward()
    backward_counts = {name: counts[name] - forward_counts[name] for name in counts}

    values, top_ids = vocab_parallel_topk(shard.float(), 9, tp_group=groups.tp, temperature=0.5)
    ref_values, ref_ids = (logits.float() / 0.5).topk(9, dim=-1)
    errors["topk_values"] = float((values - ref_values).abs().max())
    topk_ids_equal = bool(torch.equal(top_ids, ref_ids))
    return errors, forward_counts, backward_counts, topk_ids_equal


@pytest.mark.distributed
def test_tensor_parallel_2_matches_full_vocab_reference_with_one_collective():
    results = run_distributed(_tp2_checks, world_size=2, tensor_model_parallel_size=2)
    for errors, forward_counts, backward_counts, topk_ids_equal in results:
        worst = max(errors, key=errors.get)
        assert errors[worst] < ATOL, f"{worst}: {errors[worst]}"
        assert forward_counts == {"all_gather": 1, "all_reduce": 0}
        assert backward_counts == {"all_gather": 0, "all_reduce": 0}
        assert topk_ids_equal


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_masked_padding_column_adds_nothing_at_any_temperature(temperature):
    """A vocab-padding column holds float32 min (mask_vocab_padding); below temperature 1 it overflows
    to -inf in s, and must still add nothing (not NaN) to the entropy and its gradient."""
    gen = torch.Generator().manual_seed(2)
    real = torch.randn(6, 9, generator=gen)
    targets = torch.randint(0, 9, (6,), generator=gen)
    padded = torch.cat([real, torch.full((6, 2), torch.finfo(torch.float32).min)], dim=1)
    results = []
    for logits in (real, padded):
        logits = logits.clone().requires_grad_()
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, temperature=temperature)
        (log_probs.sum() + entropy.sum()).backward()
        results.append((log_probs.detach(), entropy.detach(), logits.grad[:, :9]))
    for ours, reference in zip(results[1], results[0]):
        torch.testing.assert_close(ours, reference)
