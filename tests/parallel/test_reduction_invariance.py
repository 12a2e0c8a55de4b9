"""The reduction contract: the same global batch split over DP ranks, CP ranks, micro-batches and
packings gives the same gradient (fp32 rounding) as a float64 single-process reference, for every
aggregation mode; and each micro-batch issues a fixed, small number of collectives.

Model: frozen token embeddings E [V, H] and a trainable output matrix W [H, V]; logits = E[x] W.
Loss per response token: a PPO-like ratio term, a GSPO-like term using the SEQUENCE ratio (needs
whole responses: gathered over CP, brought back to local tokens), and a sequence-level squared
log-ratio computed on the gathered replica (replicated_across_cp=True).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stacx.parallel.cp_fields import PackedLayout, next_token_targets
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.metrics_allreduce import MetricTotals, all_reduce_metric_sums
from stacx.parallel.packing import pack_micro_batches
from stacx.parallel.reduction import AGGREGATION_MODES, Reducer, StepCounts, compute_step_counts
from stacx.parallel.vocab_parallel import vocab_parallel_log_probs
from stacx.testing.distributed import run_distributed
from tests.parallel.collective_counter import install_collective_counter

VOCAB, HIDDEN, NORM_LENGTH = 29, 6, 16.0


def make_global_batch(num_samples=10, seed=7):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        prompt = int(torch.randint(1, 6, (1,), generator=gen))
        response = int(torch.randint(1, 12, (1,), generator=gen))
        mask = (torch.rand(response, generator=gen) > 0.25).double()
        if i == 3:
            mask.zero_()  # a sample without loss tokens: excluded from N_seq
        samples.append(dict(
            tokens=torch.randint(0, VOCAB, (prompt + response,), generator=gen),
            prompt_length=prompt,
            old_log_probs=-torch.rand(response, generator=gen, dtype=torch.float64) * 3 - 1,
            advantage=float(torch.randn((), generator=gen)),
            loss_mask=mask,
        ))
    embeddings = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(HIDDEN, VOCAB, generator=gen, dtype=torch.float64) * 0.5
    return samples, embeddings, weight


def per_token_terms(log_probs, old_log_probs, advantage, sequence_ratio):
    """PPO-like ratio term plus GSPO-like sequence-ratio term, per response token."""
    return -advantage * torch.exp(log_probs - old_log_probs) - 0.5 * advantage * sequence_ratio


def sequence_ratio(log_probs, old_log_probs, mask):
    return torch.exp(((log_probs - old_log_probs) * mask).sum() / mask.sum().clamp(min=1))


def reference_gradient(mode):
    """Float64, single process, whole batch at once, weights written from the mode's definition."""
    samples, embeddings, weight = make_global_batch()
    weight = weight.clone().requires_grad_()
    n = [int(s["loss_mask"].sum()) for s in samples]
    num_tokens, num_sequences = sum(n), sum(1 for c in n if c > 0)
    loss = 0.0
    for s, n_i in zip(samples, n):
        log_softmax = torch.log_softmax(embeddings[s["tokens"]] @ weight, dim=-1)
        p = s["prompt_length"]
        log_probs = log_softmax[p - 1 : -1].gather(1, s["tokens"][p:, None])[:, 0]
        ratio = sequence_ratio(log_probs, s["old_log_probs"], s["loss_mask"])
        terms = per_token_terms(log_probs, s["old_log_probs"], s["advantage"], ratio)
        terms = terms + 0.05 * (log_probs - s["old_log_probs"]) ** 2
        weight_i = {
            "token-mean": 1 / num_tokens,
            "seq-mean-token-mean": 1 / (num_sequences * n_i) if n_i else 0.0,
            "seq-mean-token-sum": 1 / num_sequences,
            "seq-mean-token-sum-norm": 1 / (num_sequences * NORM_LENGTH),
        }[mode]
        loss = loss + weight_i * (terms * s["loss_mask"]).sum()
    loss.backward()
    return weight.grad, float(loss)


def micro_batch_loss(weight, embeddings, samples, groups, reducer):
    """What a worker + specialization do for one packed micro-batch on one rank."""
    lengths = [len(s["tokens"]) for s in samples]
    layout = PackedLayout(lengths, [s["prompt_length"] for s in samples], cp_rank=groups.cp_rank, cp_size=groups.cp_size)
    tokens = torch.cat([s["tokens"] for s in samples])
    tokens_local = layout.slice_tokens(tokens)
    targets_local = layout.slice_tokens(next_token_targets(tokens, lengths))
    logits_local = embeddings[tokens_local] @ weight  # [T_local, V]
    log_probs_local = vocab_parallel_log_probs(logits_local, targets_local, tp_group=groups.tp)

    log_probs = layout.split_local_responses(log_probs_local)
    old = layout.slice_responses([s["old_log_probs"].float() for s in samples])
    masks = layout.slice_responses([s["loss_mask"].float() for s in samples])
    full_masks = [s["loss_mask"].float() for s in samples]
    full_old = [s["old_log_probs"].float() for s in samples]
    full_log_probs = layout.gather_responses(log_probs_local, groups.cp)  # the one CP collective
    ratios = [sequence_ratio(lp, o, m) for lp, o, m in zip(full_log_probs, full_old, full_masks)]
    local_ratios = layout.slice_responses([r.expand(len(m)) for r, m in zip(ratios, full_masks)])
    counts = [int(m.sum()) for m in full_masks]

    token_terms = [per_token_terms(lp, o, s["advantage"], r) for lp, o, s, r in zip(log_probs, old, samples, local_ratios)]
    loss = reducer(token_terms, masks, sequence_token_counts=counts)
    replicated_terms = [0.05 * (lp - o) ** 2 for lp, o in zip(full_log_probs, full_old)]
    loss = loss + reducer(replicated_terms, full_masks, sequence_token_counts=counts, replicated_across_cp=True)
    metric_sums = {
        "ratio_sum": sum((torch.exp(lp - o) * m).sum() for lp, o, m in zip(log_probs, old, masks)).detach(),
        "num_loss_tokens": sum(float(m.sum()) for m in masks),
    }
    return loss, metric_sums


def run_split(groups, mode, budget, permutation_seed, min_micro_batches, collective_counts=None):
    """Train-step gradient for one split; DDP emulated as sum over DP x CP then / (dp * cp)."""
    samples, embeddings, weight64 = make_global_batch()
    if permutation_seed is not None:
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(permutation_seed)).tolist()
        samples = [samples[i] for i in order]
    plan = pack_micro_batches(
        [len(s["tokens"]) for s in samples], dp_size=groups.dp_size, max_tokens_per_micro_batch=budget,
        pad_multiple=2 * groups.cp_size, min_micro_batches=min_micro_batches,
    )
    my_micro_batches = [[samples[i] for i in mb] for mb in plan.micro_batches[groups.dp_rank]]
    counts = compute_step_counts([s["loss_mask"] for mb in my_micro_batches for s in mb], groups.dp)
    reducer = Reducer.for_step(mode=mode, counts=counts, groups=groups, norm_length=NORM_LENGTH)
    weight = weight64.float().requires_grad_()
    embeddings = embeddings.float()
    totals = MetricTotals()
    loss_value = 0.0
    per_micro_batch = []
    for micro_batch in my_micro_batches:
        before = dict(collective_counts) if collective_counts is not None else None
        loss, metric_sums = micro_batch_loss(weight, embeddings, micro_batch, groups, reducer)
        loss.backward()
        totals.add(all_reduce_metric_sums(metric_sums, groups.dp_cp))
        loss_value += reducer.loss_value(loss)
        if collective_counts is not None:
            per_micro_batch.append({k: collective_counts[k] - before[k] for k in collective_counts})
    grad = weight.grad.clone()
    if groups.dp_cp_size > 1:
        dist.all_reduce(grad, group=groups.dp_cp)
        loss_tensor = torch.tensor([loss_value], dtype=torch.float64)
        dist.all_reduce(loss_tensor, group=groups.dp_cp)
        loss_value = float(loss_tensor)
    grad /= groups.dp_cp_size
    return dict(grad=grad, loss=loss_value, counts=counts, metric_tokens=totals.sums["num_loss_tokens"],
                num_micro_batches=plan.num_micro_batches, per_micro_batch=per_micro_batch)


def build_groups(dp_size, cp_size):
    """ProcessGroups for a (dp, cp) factorization of the world: CP peers are consecutive ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    assert dp_size * cp_size == world
    cp_group = dp_group = None
    for d in range(dp_size):
        ranks = [d * cp_size + c for c in range(cp_size)]
        group = dist.new_group(ranks) if cp_size > 1 else None
        if rank in ranks:
            cp_group = group
    for c in range(cp_size):
        ranks = [d * cp_size + c for d in range(dp_size)]
        group = dist.new_group(ranks) if dp_size > 1 else None
        if rank in ranks:
            dp_group = group
    return ProcessGroups(tp=None, cp=cp_group, dp=dp_group, dp_cp=dist.group.WORLD)


#: (dp, cp, token budget per micro-batch, sample permutation seed, min micro-batches)
DISTRIBUTED_SPLITS = [
    (4, 1, 24, None, 1),
    (2, 2, 40, 1, 1),
    (1, 4, 200, 2, 1),
    (2, 2, 64, 3, 3),
]


def _invariance_on_four_ranks(_groups):
    layouts = {(dp, cp): build_groups(dp, cp) for dp, cp in sorted({(s[0], s[1]) for s in DISTRIBUTED_SPLITS})}
    counts = install_collective_counter()
    results = {}
    for split in DISTRIBUTED_SPLITS:
        dp, cp, budget, permutation, min_mb = split
        for mode in AGGREGATION_MODES:
            results[(split, mode)] = run_split(layouts[(dp, cp)], mode, budget, permutation, min_mb, counts)
    return results


@pytest.fixture(scope="module")
def four_rank_results():
    """One spawn of 4 ranks runs every distributed split and mode (spawns are the expensive part)."""
    return run_distributed(_invariance_on_four_ranks, world_size=4, timeout_s=240)


@pytest.mark.slow
@pytest.mark.distributed
def test_gradient_is_invariant_to_dp_cp_micro_batch_and_packing_splits(four_rank_results):
    rank_results = four_rank_results
    single = ProcessGroups.single_process()
    masks = [s["loss_mask"] for s in make_global_batch()[0]]
    expected_counts = StepCounts(num_tokens=int(sum(m.sum() for m in masks)), num_sequences=sum(int(m.sum() > 0) for m in masks))
    for mode in AGGREGATION_MODES:
        expected_grad, expected_loss = reference_gradient(mode)
        tolerance = 2e-5 * float(expected_grad.abs().max())
        splits = [("single process, 3 micro-batches", run_split(single, mode, 30, 5, 3))]
        splits += [(f"dp={s[0]} cp={s[1]} budget={s[2]}", rank_results[0][(s, mode)]) for s in DISTRIBUTED_SPLITS]
        micro_batch_counts = {s[1]["num_micro_batches"] for s in splits}
        assert len(micro_batch_counts) >= 3, "the splits should use different numbers of micro-batches"
        for name, result in splits:
            torch.testing.assert_close(
                result["grad"].double(), expected_grad, atol=tolerance, rtol=0, msg=lambda m: f"{mode}, {name}: {m}"
            )
            assert result["loss"] == pytest.approx(expected_loss, rel=1e-5), f"{mode}, {name}"
            assert result["counts"] == expected_counts
            assert result["metric_tokens"] == result["counts"].num_tokens
    for rank, results in enumerate(rank_results):  # every rank saw the same reduced gradient
        for key, result in results.items():
            torch.testing.assert_close(result["grad"], rank_results[0][key]["grad"], atol=0, rtol=0)


@pytest.mark.distributed
def test_collectives_per_micro_batch_are_fixed(four_rank_results):
    """Per micro-batch: with CP, one all-gather (forward) + one all-reduce (its backward) + one metrics
    all-reduce; without CP only the metrics all-reduce. Vocab-parallel adds none at TP=1."""
    for results in four_rank_results:
        for (split, mode), result in results.items():
            cp = split[1]
            expected = {"all_gather": 1 if cp > 1 else 0, "all_reduce": 2 if cp > 1 else 1}
            per_micro_batch = result["per_micro_batch"]
            assert per_micro_batch and all(c == expected for c in per_micro_batch), (split, mode, per_micro_batch)


def test_reducer_rejects_bad_configuration():
    counts = StepCounts(num_tokens=10, num_sequences=2)
    with pytest.raises(ValueError, match="known modes"):
        Reducer(mode="mean", counts=counts, gradient_average_size=1)
    with pytest.raises(ValueError, match="norm_length"):
        Reducer(mode="seq-mean-token-sum-norm", counts=counts, gradient_average_size=1)
    reducer = Reducer(mode="seq-mean-token-mean", counts=counts, gradient_average_size=2, cp_size=2)
    with pytest.raises(ValueError, match="sequence_token_counts"):
        reducer([torch.ones(3)], [torch.ones(3)])
