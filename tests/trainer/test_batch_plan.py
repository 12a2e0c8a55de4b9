"""Micro-batch plans of a step batch: DPO pairs kept together, ranks balanced, errors naming the problem."""

from __future__ import annotations

import pytest

from stacx.trainer.batch import StepBatch, plan_micro_batches


def _example(prompt, chosen, rejected):
    from stacx.rollout.data import Example

    return Example(prompt_ids=prompt, source="test", chosen_ids=chosen, rejected_ids=rejected)


def test_plan_keeps_dpo_pairs_together_and_balances_ranks():
    batch = StepBatch.preference_pairs([_example([1, 2], [3] * n, [4] * (5 - n)) for n in (1, 2, 3, 4)])
    plan = plan_micro_batches(batch, dp_size=2, cp_size=1, max_tokens_per_micro_batch=20)
    assert len(plan) == 2 and len(plan[0]) == len(plan[1])
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(8))
    for rank in plan:
        for mb in rank:
            pairs = [batch.pair_ids[i] for i in mb]
            assert all(pairs.count(p) == 2 for p in pairs)  # chosen and rejected share the micro-batch


def test_plan_errors_name_the_problem():
    batch = StepBatch.supervised([[1, 2]] * 2, [[3, 4, 5]] * 2)
    with pytest.raises(ValueError, match="2 samples .* for 4 data-parallel ranks"):
        plan_micro_batches(batch, dp_size=4, cp_size=1, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4"):
        plan_micro_batches(batch, dp_size=1, cp_size=1, max_tokens_per_micro_batch=4)
    # Under CP every sample is padded to a multiple of 2*cp before it is packed.
    # 5 + 5 tokens fit a budget of 12 at cp=1; padded to 8 + 8 at cp=2 they need two micro-batches.
    assert plan_micro_batches(batch, dp_size=1, cp_size=1, max_tokens_per_micro_batch=12) == [[[0, 1]]]
    assert sorted(plan_micro_batches(batch, dp_size=1, cp_size=2, max_tokens_per_micro_batch=12)[0]) == [[0], [1]]
