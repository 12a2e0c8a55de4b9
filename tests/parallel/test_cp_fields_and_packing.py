"""CP slicing of packed micro-batches (pure index math) and micro-batch packing."""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.cp_fields import PackedLayout, next_token_targets
from stacx.parallel.metrics_allreduce import MetricTotals, all_reduce_metric_sums
from stacx.parallel.packing import pack_micro_batches

LENGTHS, PROMPTS = [7, 10, 3, 12], [3, 2, 1, 5]


def test_next_token_targets_stay_inside_each_sequence():
    tokens = torch.arange(100, 100 + sum(LENGTHS))
    targets = next_token_targets(tokens, LENGTHS, fill=-1)
    start = 0
    for n in LENGTHS:
        assert targets[start : start + n - 1].tolist() == tokens[start + 1 : start + n].tolist()
        assert int(targets[start + n - 1]) == -1
        start += n


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_cp_slices_partition_every_field_and_round_trip(cp_size):
    tokens = torch.arange(sum(LENGTHS))
    field_2d = torch.randn(sum(LENGTHS), 3)
    responses = [torch.randn(n - p, 2) for n, p in zip(LENGTHS, PROMPTS)]
    layouts = [PackedLayout(LENGTHS, PROMPTS, cp_rank=r, cp_size=cp_size) for r in range(cp_size)]

    # Tokens: every real token lands on exactly one rank, with its own 2-D field row.
    seen = torch.cat([layout.slice_tokens(tokens, fill=-1) for layout in layouts])
    assert sorted(seen[seen >= 0].tolist()) == tokens.tolist()
    for layout in layouts:
        local_tokens = layout.slice_tokens(tokens, fill=-1)
        local_field = layout.slice_tokens(field_2d)
        real = local_tokens >= 0
        assert torch.equal(local_field[real], field_2d[local_tokens[real]])
        assert layout.num_local_tokens == sum(layout.padded_lengths) // cp_size

    # Responses: each response token on exactly one rank, and the local prediction position of
    # response token j of sequence i is the one that holds sequence position prompt_i - 1 + j.
    targets = next_token_targets(tokens, LENGTHS)
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
        offsets = torch.cat([layout.local_response_offsets[i] for layout in layouts])
        assert sorted(offsets.tolist()) == list(range(n - p))
    for layout in layouts:
        local_targets = layout.split_local_responses(layout.slice_tokens(targets))
        starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
        for i, (piece, offsets) in enumerate(zip(local_targets, layout.local_response_offsets)):
            # The target predicted at that position is the response token itself.
            assert piece.tolist() == (starts[i] + PROMPTS[i] + offsets).tolist()
        sliced = layout.slice_responses(responses)
        for i, (piece, offsets) in enumerate(zip(sliced, layout.local_response_offsets)):
            assert torch.equal(piece, responses[i][offsets])


def test_gather_responses_single_rank_is_the_identity_on_responses():
    layout = PackedLayout(LENGTHS, PROMPTS)
    values = torch.randn(sum(LENGTHS), requires_grad=True)
    full = layout.gather_responses(values, None)
    assert [len(f) for f in full] == layout.response_lengths
    assert torch.equal(torch.cat(full), torch.cat(layout.split_local_responses(values)))
    torch.cat(full).sum().backward()
    assert int(values.grad.sum()) == sum(layout.response_lengths)


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="prompt_lengths\\[0\\]"):
        PackedLayout([5], [0])
    with pytest.raises(ValueError, match="cp_rank"):
        PackedLayout([5], [1], cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match="tokens"):
        PackedLayout([5], [1]).slice_tokens(torch.zeros(4))


def test_packing_respects_budget_balances_and_covers_every_sample_once():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (64,), generator=gen).tolist()
    plan = pack_micro_batches(lengths, dp_size=4, max_tokens_per_micro_batch=1024, pad_multiple=4)
    indices = sorted(i for rank in plan.micro_batches for mb in rank for i in mb)
    assert indices == list(range(64))
    tokens = plan.micro_batch_tokens()
    assert all(len(rank) == plan.num_micro_batches for rank in tokens)
    assert max(t for rank in tokens for t in rank) <= 1024
    assert plan.num_micro_batches == -(-sum(plan.padded_lengths) // (4 * 1024))  # the minimum possible
    assert plan.rank_imbalance < 1.05 and plan.micro_batch_imbalance < 1.15
    expected_padding = (sum(plan.padded_lengths) - sum(lengths)) / sum(plan.padded_lengths)
    assert plan.padding_fraction == pytest.approx(expected_padding) and 0 < plan.padding_fraction < 0.02


def test_packing_rejects_samples_over_budget():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=100"):
        pack_micro_batches([50, 101], dp_size=1, max_tokens_per_micro_batch=100)
    with pytest.raises(ValueError, match="dp_size=4"):
        pack_micro_batches([5, 5], dp_size=4, max_tokens_per_micro_batch=100)


def test_metric_sums_single_process_and_accumulation():
    reduced = all_reduce_metric_sums({"b": torch.tensor(3.0), "a": 2}, None)
    assert reduced == {"a": 2.0, "b": 3.0}
    totals = MetricTotals()
    totals.add(reduced)
    totals.add({"a": 1.0, "b": 1.0})
    assert totals.sums == {"a": 3.0, "b": 4.0}
