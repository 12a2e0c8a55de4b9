"""Fused LM-head log-probs against the unfused path (logits = h W^T, then vocab-parallel log-probs)."""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.fused_lm_head_logprobs import (
    default_tile,
    fused_lm_head_log_probs_and_entropy,
    fused_lm_head_log_probs_at_ids,
)
from stacx.parallel.lm_head import mask_vocab_padding
from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy
from stacx.parallel.vocab_parallel_topk import vocab_parallel_log_probs_at_ids
from stacx.testing.distributed import run_distributed
from tests.parallel.collective_counter import install_collective_counter

#: Target of issue 16: gradients equal to the unfused path to 1e-5 relative (fp32).
RELATIVE_TOLERANCE = 1e-5


def make_problem(num_tokens=21, hidden_size=16, vocab=48, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.5
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    ids = torch.randint(0, vocab, (num_tokens, k), generator=gen)
    ids[:, 1] = ids[:, 0]  # duplicate ids must accumulate gradients
    grad_lp = torch.randn(num_tokens, generator=gen)
    grad_h = torch.randn(num_tokens, generator=gen)
    grad_ids = torch.randn(num_tokens, k, generator=gen)
    return hidden, weight, targets, ids, grad_lp, grad_h, grad_ids


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference| (the reference is checked to be non-trivial)."""
    scale = float(reference.abs().max())
    assert scale > 1e-3, "trivial reference: the comparison would prove nothing"
    return float((ours.double() - reference.double()).abs().max()) / scale


def unfused_results(hidden, weight, targets, ids, grad_lp, grad_h, grad_ids, temperature):
    """The unfused path in one process over the full vocab: outputs and d(objective)/d(h, W)."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logits = h @ w.t()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, temperature=temperature)
    at_ids, _ = vocab_parallel_log_probs_at_ids(logits, ids, temperature=temperature)
    objective = (log_probs * grad_lp).sum() + (entropy * grad_h).sum() + (at_ids * grad_ids).sum()
    objective.backward()
    return log_probs.detach(), entropy.detach(), at_ids.detach(), h.grad, w.grad


def fused_results(hidden, weight_shard, targets, ids, grad_lp, grad_h, grad_ids, temperature, tile, tp_group):
    h = hidden.clone().requires_grad_()
    w = weight_shard.clone().requires_grad_()
    chunk_tokens, vocab_block = tile
    tiling = dict(tp_group=tp_group, temperature=temperature, chunk_tokens=chunk_tokens, vocab_block=vocab_block)
    log_probs, entropy = fused_lm_head_log_probs_and_entropy(h, w, targets, **tiling)
    at_ids, _ = fused_lm_head_log_probs_at_ids(h, w, ids, **tiling)
    objective = (log_probs * grad_lp).sum() + (entropy * grad_h).sum() + (at_ids * grad_ids).sum()
    objective.backward()
    return log_probs.detach(), entropy.detach(), at_ids.detach(), h.grad, w.grad


NAMES = ("log_probs", "entropy", "log_probs_at_ids", "grad_hidden", "grad_weight")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
# (chunk_tokens, vocab_block): defaults, one token per chunk, ragged tiles both ways, one tile.
@pytest.mark.parametrize("tile", [(None, None), (1, 7), (4, 5), (None, 1), (1000, 1000)])
def test_fused_matches_unfused_values_and_gradients(temperature, tile):
    problem = make_problem()
    expected = unfused_results(*problem, temperature)
    got = fused_results(*problem, temperature, tile, None)
    for name, ours, ref in zip(NAMES, got, expected):
        assert relative_error(ours, ref) <= RELATIVE_TOLERANCE, name


def test_leading_dimensions_are_kept():
    hidden, weight, targets, *_ = make_problem(num_tokens=12)
    log_probs, entropy = fused_lm_head_log_probs_and_entropy(hidden.view(3, 4, -1), weight, targets.view(3, 4))
    ref_lp, ref_h = vocab_parallel_log_probs_and_entropy(hidden @ weight.t(), targets)
    assert log_probs.shape == entropy.shape == (3, 4)
    torch.testing.assert_close(log_probs.view(-1), ref_lp)
    torch.testing.assert_close(entropy.view(-1), ref_h)


def saved_by_fused_node(output):
    pending = [output.grad_fn]
    while pending:
        node = pending.pop()
        if "FusedLMHeadLogProbs" in type(node).__name__:
            return [t for t in node.saved_tensors if t is not None]
        pending.extend(fn for fn, _ in node.next_functions if fn is not None)
    raise AssertionError("no fused LM-head node in the graph")


def test_entropy_only_when_asked_and_no_entropy_state_without_its_gradient():
    hidden, weight, targets, *_ = make_problem()
    h = hidden.clone().requires_grad_()
    log_probs, entropy = fused_lm_head_log_probs_and_entropy(h, weight, targets, with_entropy=False)
    assert entropy is None
    # hidden, weight, local ids, owned mask, lse: no entropy tensor.
    assert len(saved_by_fused_node(log_probs)) == 5
    _, detached = fused_lm_head_log_probs_and_entropy(h, weight, targets, entropy_requires_grad=False)
    assert not detached.requires_grad
    _, with_grad = fused_lm_head_log_probs_and_entropy(h, weight, targets)
    assert with_grad.requires_grad and len(saved_by_fused_node(with_grad)) == 6
    torch.testing.assert_close(detached, with_grad.detach())


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, targets, *_ = make_problem()
    h = hidden.clone().requires_grad_()
    log_probs, _ = fused_lm_head_log_probs_and_entropy(h, weight, targets, with_entropy=False, chunk_tokens=5, vocab_block=9)
    log_probs.sum().backward()
    assert weight.grad is None
    h_ref = hidden.clone().requires_grad_()
    vocab_parallel_log_probs_and_entropy(h_ref @ weight.t(), targets, with_entropy=False)[0].sum().backward()
    assert relative_error(h.grad, h_ref.grad) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("chunk_tokens", [5, None])  # several token chunks (fp32 dW accumulator) and one
def test_bf16_inputs_give_bf16_gradients_close_to_unfused(chunk_tokens):
    hidden, weight, targets, *_ = make_problem()
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    log_probs, entropy = fused_lm_head_log_probs_and_entropy(h, w, targets, chunk_tokens=chunk_tokens, vocab_block=10)
    (log_probs.sum() + 0.1 * entropy.sum()).backward()
    h_ref, w_ref = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    ref_lp, ref_h = vocab_parallel_log_probs_and_entropy(h_ref @ w_ref.t(), targets, chunk_tokens=5)
    (ref_lp.sum() + 0.1 * ref_h.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16 and log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs, ref_lp)
    assert relative_error(h.grad, h_ref.grad) < 2e-2
    assert relative_error(w.grad, w_ref.grad) < 2e-2


def test_no_logits_sized_tensor_is_ever_allocated():
    """Every allocation of forward+backward is at most a gradient of an input, its fp32 accumulator or
    an fp32 tile; the unfused path (the guard that the measurement sees logits) allocates the whole
    [T, V] shard."""
    from torch.profiler import ProfilerActivity, profile

    num_tokens, hidden_size, vocab, chunk, block = 256, 8, 4096, 64, 128
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)

    def largest_allocation(step):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        return max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")

    def fused():
        log_probs, entropy = fused_lm_head_log_probs_and_entropy(
            hidden, weight, targets, chunk_tokens=chunk, vocab_block=block
        )
        (log_probs.sum() + entropy.sum()).backward()

    def unfused():
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(hidden @ weight.t(), targets, chunk_tokens=chunk)
        (log_probs.sum() + entropy.sum()).backward()

    shard_bytes = num_tokens * vocab * 4
    bound = max(chunk * block * 4, weight.numel() * 4, hidden.numel() * 4)
    assert bound * 4 <= shard_bytes  # the sizes keep the two regimes apart
    assert largest_allocation(fused) <= bound
    assert largest_allocation(unfused) >= shard_bytes


def test_default_tile_at_the_gpu_target_shape_keeps_temporaries_under_a_tenth_of_the_shard():
    """Vocab 151,936 and 4k tokens in bf16: ~12 bytes per tile element against 2 per shard element."""
    chunk_tokens, vocab_block = default_tile(4096, 151936)
    assert (chunk_tokens, vocab_block) == (4096, 2048)
    assert 12 * chunk_tokens * vocab_block <= 0.1 * 2 * 4096 * 151936
    assert default_tile(10, 48) == (10, 48)  # a small vocabulary is one block
    assert default_tile(100_000, 151936) == (4096, 2048)  # long batches go in several token chunks


def test_bad_inputs_raise_errors_that_name_the_argument():
    hidden, weight, targets, *_ = make_problem()
    with pytest.raises(ValueError, match=r"weight must be the output layer's shard \[V/tp, H\]"):
        fused_lm_head_log_probs_and_entropy(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_lm_head_log_probs_and_entropy(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="vocab_size=48"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, targets + 48)
    with pytest.raises(ValueError, match="leading shape"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="temperature"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="vocab_block"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, targets, vocab_block=0)


# ---- spawned gloo ranks, TP = 1 and TP = 2, against the single-process unfused reference -------


def _tensor_parallel_checks(groups):
    counts = install_collective_counter()
    tp, rank = groups.tp_size, groups.tp_rank
    problem = make_problem(num_tokens=19, hidden_size=12, vocab=48, k=5, seed=3)
    hidden, weight = problem[0], problem[1]
    vocab_local = weight.shape[0] // tp
    rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
    errors = {}
    for temperature in (1.0, 0.8):
        expected = unfused_results(*problem, temperature)
        expected = expected[:4] + (expected[4][rows],)  # this rank's rows of d/dW
        for tile in ((None, None), (3, 5)):
            got = fused_results(hidden, weight[rows], *problem[2:], temperature, tile, groups.tp)
            for name, ours, ref in zip(NAMES, got, expected):
                errors[f"{name}/T={temperature}/tile={tile}"] = relative_error(ours, ref)

    for name in counts:
        counts[name] = 0
    h = hidden.clone().requires_grad_()
    log_probs, entropy = fused_lm_head_log_probs_and_entropy(h, weight[rows], problem[2], tp_group=groups.tp, chunk_tokens=4, vocab_block=7)
    forward_counts = dict(counts)
    (log_probs.sum() + entropy.sum()).backward()
    backward_counts = {name: counts[name] - forward_counts[name] for name in counts}
    return errors, forward_counts, backward_counts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tensor_model_parallel_size", [1, 2])
def test_tensor_parallel_matches_single_process_unfused_reference(tensor_model_parallel_size):
    results = run_distributed(
        _tensor_parallel_checks, world_size=tensor_model_parallel_size, tensor_model_parallel_size=tensor_model_parallel_size
    )
    for errors, forward_counts, backward_counts in results:
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RELATIVE_TOLERANCE, f"{worst}: {errors[worst]}"
        if tensor_model_parallel_size > 1:
            # Forward: one all-gather of the statistics; backward: one all-reduce of d/dhidden.
            assert forward_counts == {"all_gather": 1, "all_reduce": 0}
            assert backward_counts == {"all_gather": 0, "all_reduce": 1}


# ---- vocab padding: rows with a global id >= vocab_size are excluded like the masked logits -----


def padded_problem(vocab_size, padded_vocab=48, seed=4):
    """The shared problem over `padded_vocab` weight rows, ids below the real `vocab_size`; the padding
    rows are large, so any leak of theirs into lse, entropy or a gradient would show."""
    hidden, weight, _, _, grad_lp, grad_h, grad_ids = make_problem(num_tokens=17, hidden_size=12, vocab=padded_vocab,
                                                                   k=3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weight[vocab_size:] *= 8.0
    targets = torch.randint(0, vocab_size, (17,), generator=gen)
    ids = torch.randint(0, vocab_size, (17, 3), generator=gen)
    return hidden, weight, targets, ids, grad_lp, grad_h, grad_ids


def masked_unfused_results(hidden, weight, targets, ids, grad_lp, grad_h, grad_ids, temperature, vocab_size):
    """The unfused path of the trainer: logits with float32 min in the padding columns (one process)."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logits = mask_vocab_padding(h @ w.t(), vocab_size, 0)
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, temperature=temperature)
    at_ids, _ = vocab_parallel_log_probs_at_ids(logits, ids, temperature=temperature)
    objective = (log_probs * grad_lp).sum() + (entropy * grad_h).sum() + (at_ids * grad_ids).sum()
    objective.backward()
    return log_probs.detach(), entropy.detach(), at_ids.detach(), h.grad, w.grad


def _padded_vocab_checks(groups, vocab_size):
    """(relative errors, max |d/dW| over the padding rows) of this rank against the masked unfused path."""
    tp, rank = groups.tp_size, groups.tp_rank
    problem = padded_problem(vocab_size)
    hidden, weight, targets, ids, grad_lp, grad_h, grad_ids = problem
    vocab_local = weight.shape[0] // tp
    rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
    errors, padding_grads = {}, []
    for temperature in (1.0, 0.7):
        expected = masked_unfused_results(*problem, temperature, vocab_size)
        expected = expected[:4] + (expected[4][rows],)
        for chunk_tokens, vocab_block in ((None, None), (4, 5)):
            h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
            options = dict(tp_group=groups.tp, temperature=temperature, chunk_tokens=chunk_tokens,
                           vocab_block=vocab_block, vocab_size=vocab_size)
            log_probs, entropy = fused_lm_head_log_probs_and_entropy(h, w, targets, **options)
            at_ids, _ = fused_lm_head_log_probs_at_ids(h, w, ids, **options)
            ((log_probs * grad_lp).sum() + (entropy * grad_h).sum() + (at_ids * grad_ids).sum()).backward()
            got = (log_probs.detach(), entropy.detach(), at_ids.detach(), h.grad, w.grad)
            first_padding = max(0, vocab_size - rank * vocab_local)
            # A shard of padding only has an all-zero d/dW: checked exactly below, not relatively.
            names = NAMES if first_padding else NAMES[:4]
            for name, ours, ref in zip(names, got, expected):
                errors[f"{name}/T={temperature}/tile={chunk_tokens, vocab_block}"] = relative_error(ours, ref)
            padding_grads.append(float(w.grad[first_padding:].abs().max()) if first_padding < vocab_local else 0.0)
    return errors, padding_grads


def _padded_vocab_checks_on_rank(groups, vocab_sizes):
    return [_padded_vocab_checks(groups, vocab_size) for vocab_size in vocab_sizes]


def check_padded_results(results):
    for errors, padding_grads in results:
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RELATIVE_TOLERANCE, f"{worst}: {errors[worst]}"
        assert padding_grads and max(padding_grads) == 0.0  # padding rows get exactly no gradient


def test_padded_vocab_rows_are_excluded_like_the_masked_logits_in_one_shard():
    from stacx.parallel.groups import ProcessGroups

    check_padded_results([_padded_vocab_checks(ProcessGroups.single_process(), 45)])


@pytest.mark.distributed
def test_padded_vocab_rows_are_excluded_like_the_masked_logits_over_two_tp_ranks():
    # 48 padded rows: 45 real (the last shard partly padding, as megatron pads) and 20 real (the last
    # shard all padding). One spawn for both.
    per_rank = run_distributed(_padded_vocab_checks_on_rank, world_size=2, tensor_model_parallel_size=2, args=((45, 20),))
    check_padded_results([result for rank_results in per_rank for result in rank_results])


def test_padding_changes_the_result_and_padding_ids_or_sizes_are_refused():
    hidden, weight, targets, *_ = padded_problem(45)
    padded, _ = fused_lm_head_log_probs_and_entropy(hidden, weight, targets, vocab_size=45)
    unpadded, _ = fused_lm_head_log_probs_and_entropy(hidden, weight, targets)
    assert float((padded - unpadded).abs().max()) > 1e-3  # the guard: excluding the rows matters here
    with pytest.raises(ValueError, match="vocab_size=45"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, torch.full_like(targets, 46), vocab_size=45)
    with pytest.raises(ValueError, match="vocab_size must be the real vocab"):
        fused_lm_head_log_probs_and_entropy(hidden, weight, targets, vocab_size=49)
