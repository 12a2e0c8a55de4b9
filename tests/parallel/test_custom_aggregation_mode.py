"""One definition of the loss aggregation modes: a mode registered in the objectives registry
drives the distributed `Reducer`, and the Reducer agrees with `aggregate_sum / count_normalizer`.

The custom mode weights sequence i by 1 / sqrt(n_i) and normalizes by the number of sequences:

    L = sum_i (1 / (N_seq * sqrt(n_i))) sum_t m_it l_it

The references below write this formula out by hand in float64, independent of the registry.
"""

from __future__ import annotations

import pytest
import torch

from stacx.objectives.aggregation import (
    BUILTIN_AGGREGATION_MODE_NAMES,
    SAMPLES,
    AggregationMode,
    aggregate_sum,
    count_normalizer,
    get_aggregation_mode,
    loss_token_count,
    register_aggregation_mode,
)
from stacx.objectives.registry import AGGREGATIONS
from stacx.parallel.reduction import AGGREGATION_MODES, Reducer, StepCounts, compute_step_counts, count_loss_tokens
from stacx.testing.distributed import run_distributed

CUSTOM_MODE = "test-seq-mean-token-sqrt"
NORM_LENGTH = 9.0
TOLERANCE = 1e-12  # float64 throughout; only summation order differs


def inverse_sqrt_token_count(n_i: torch.Tensor, _norm_length: float | None) -> torch.Tensor:
    return n_i.rsqrt()


def ensure_custom_mode_registered() -> None:
    """Register CUSTOM_MODE once per process (the spawned ranks register it themselves)."""
    if CUSTOM_MODE not in AGGREGATIONS:
        register_aggregation_mode(AggregationMode(CUSTOM_MODE, SAMPLES, inverse_sqrt_token_count))


@pytest.fixture
def custom_mode():
    ensure_custom_mode_registered()
    yield CUSTOM_MODE
    AGGREGATIONS.unregister(CUSTOM_MODE)


def make_batch(num_sequences=8, seed=3):
    """Per-sequence float64 (losses, 0/1 masks) with a requires-grad parameter scaling the losses."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(num_sequences, dtype=torch.float64, generator=gen)
    raw, masks = [], []
    for i in range(num_sequences):
        length = int(torch.randint(1, 9, (1,), generator=gen))
        raw.append(torch.randn(length, dtype=torch.float64, generator=gen))
        mask = (torch.rand(length, generator=gen) > 0.3).to(torch.float64)
        if i == 2:
            mask.zero_()  # no loss tokens: weight 0, not counted in N_seq
        masks.append(mask)
    return theta, raw, masks


def losses_of(theta, raw):
    """l_it = theta_i * raw_it + theta_i^2 (a per-sequence parameter, so gradients differ by i)."""
    return [theta[i] * r + theta[i] ** 2 for i, r in enumerate(raw)]


def custom_reference(theta, raw, masks):
    """(loss, dloss/dtheta) of the custom mode, written out by hand."""
    theta = theta.clone().requires_grad_()
    counts = [float((m != 0).sum()) for m in masks]
    num_sequences = sum(1 for n in counts if n > 0)
    loss = sum((l * m).sum() / (num_sequences * n ** 0.5) for l, m, n in zip(losses_of(theta, raw), masks, counts) if n > 0)
    loss.backward()
    return float(loss), theta.grad


def test_custom_mode_drives_reducer_single_process(custom_mode):
    theta, raw, masks = make_batch()
    expected_loss, expected_grad = custom_reference(theta, raw, masks)

    num_tokens, num_sequences = count_loss_tokens(masks)
    reducer = Reducer(mode=custom_mode, counts=StepCounts(num_tokens=num_tokens, num_sequences=num_sequences),
                      gradient_average_size=1)
    theta_r = theta.clone().requires_grad_()
    losses = losses_of(theta_r, raw)
    total = 0.0
    for part in (slice(0, 3), slice(3, 5), slice(5, None)):  # three micro-batches
        reduced = reducer(losses[part], masks[part])
        reduced.backward(retain_graph=True)
        total += reducer.loss_value(reduced)
    assert abs(total - expected_loss) < TOLERANCE
    torch.testing.assert_close(theta_r.grad, expected_grad, rtol=0, atol=TOLERANCE)

    # The objectives' sum / count path uses the same definition.
    objective = aggregate_sum(losses_of(theta, raw), masks, custom_mode) / count_normalizer(masks, custom_mode)
    assert abs(float(objective) - expected_loss) < TOLERANCE

    # Under CP the mode's factor needs whole-sequence counts, like seq-mean-token-mean.
    cp_reducer = Reducer(mode=custom_mode, counts=StepCounts(num_tokens=5, num_sequences=2),
                         gradient_average_size=2, cp_size=2)
    with pytest.raises(ValueError, match="sequence_token_counts"):
        cp_reducer([torch.ones(3)], [torch.ones(3)])


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_reducer_matches_objectives_sum_over_count(mode):
    """For every built-in mode, Reducer on one process == aggregate_sum / count_normalizer."""
    assert set(BUILTIN_AGGREGATION_MODE_NAMES) == set(AGGREGATION_MODES)
    theta, raw, masks = make_batch(seed=11)
    losses = losses_of(theta, raw)
    num_tokens, num_sequences = count_loss_tokens(masks)
    reducer = Reducer(mode=mode, counts=StepCounts(num_tokens=num_tokens, num_sequences=num_sequences),
                      gradient_average_size=1, norm_length=NORM_LENGTH)
    via_reducer = reducer.loss_value(reducer(losses, masks))
    via_objectives = float(aggregate_sum(losses, masks, mode, seq_norm_len=NORM_LENGTH) / count_normalizer(masks, mode))
    assert abs(via_reducer - via_objectives) < TOLERANCE


def test_token_count_convention_counts_nonzero_entries():
    """n_i is the number of non-zero mask entries everywhere (not the sum of mask values)."""
    masks = [torch.tensor([0.5, 0.0, 0.25, 1.0]), torch.tensor([0.0, 0.0])]
    losses = [torch.tensor([2.0, 7.0, 4.0, 1.0], dtype=torch.float64), torch.tensor([3.0, 3.0], dtype=torch.float64)]
    assert int(loss_token_count(masks[0])) == 3
    assert count_loss_tokens(masks) == (3, 1)
    assert float(count_normalizer(masks, "token-mean")) == 3.0
    assert float(count_normalizer(masks, "seq-mean-token-mean")) == 1.0
    # seq-mean-token-mean: (0.5*2 + 0.25*4 + 1*1) / 3 with the mask values as token weights.
    assert float(aggregate_sum(losses, masks, "seq-mean-token-mean")) == pytest.approx(3.0 / 3, abs=1e-12)
    reducer = Reducer(mode="seq-mean-token-mean", counts=StepCounts(num_tokens=3, num_sequences=1), gradient_average_size=1)
    assert reducer.sequence_weights([3, 0]).tolist() == [1.0 / 3, 0.0]


def test_bad_aggregation_mode_definitions_are_rejected():
    with pytest.raises(ValueError, match="normalizer"):
        AggregationMode("bad-normalizer", "rows", inverse_sqrt_token_count)
    with pytest.raises(ValueError, match="not callable"):
        AggregationMode("bad-factor", SAMPLES, 1.0)
    with pytest.raises(ValueError, match="already registered"):
        register_aggregation_mode(get_aggregation_mode("token-mean"))
    with pytest.raises(ValueError, match="known modes"):
        Reducer(mode="no-such-mode", counts=StepCounts(num_tokens=1, num_sequences=1), gradient_average_size=1)


def _custom_mode_data_parallel_rank(groups):
    """One DP rank: its half of the batch in two micro-batches; DDP emulated by all-reduce / dp."""
    import torch.distributed as dist

    ensure_custom_mode_registered()
    theta, raw, masks = make_batch()
    mine = list(range(groups.dp_rank, len(raw), groups.dp_size))
    counts = compute_step_counts([masks[i] for i in mine], groups.dp)
    reducer = Reducer.for_step(mode=CUSTOM_MODE, counts=counts, groups=groups)
    theta = theta.clone().requires_grad_()
    losses = losses_of(theta, raw)
    loss_sum = 0.0
    for micro_batch in (mine[:2], mine[2:]):
        reduced = reducer([losses[i] for i in micro_batch], [masks[i] for i in micro_batch])
        reduced.backward(retain_graph=True)
        loss_sum += reducer.loss_value(reduced)
    grad = theta.grad.clone()
    dist.all_reduce(grad, group=groups.dp)
    loss = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(loss, group=groups.dp)
    return float(loss), grad / groups.dp_cp_size, (counts.num_tokens, counts.num_sequences)


@pytest.mark.distributed
def test_custom_mode_drives_reducer_over_data_parallel_ranks():
    theta, raw, masks = make_batch()
    expected_loss, expected_grad = custom_reference(theta, raw, masks)
    results = run_distributed(_custom_mode_data_parallel_rank, world_size=2, timeout_s=120)
    for loss, grad, counts in results:
        assert counts == count_loss_tokens(masks)
        assert abs(loss - expected_loss) < TOLERANCE
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=TOLERANCE)
