"""`StepBatch`: built from rollout samples, cut into rank shards and packed into the `MicroBatch` a
specialization reads; read by the advantage estimators under the same names (`prompt_id`,
`log_probs`), and shared between torchrun ranks without pickle."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stacx.objectives import get_advantage
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.trainer.batch import StepBatch, plan_micro_batches
from stacx.trainer.cluster.rank_messages import decode_message, encode_message
from stacx.wire.sample import Sample


def _samples():
    return [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], rollout_log_probs=[-0.5, -1.0, -2.0],
                   loss_mask=[1, 1, 0], executors=[1, 1, 1], group_index=0, reward=1.0),
            Sample(prompt_ids=[1, 2], response_ids=[6], rollout_log_probs=[-0.1], loss_mask=[1],
                   executors=[1], group_index=0, reward=0.0),
            Sample(prompt_ids=[7], response_ids=[8, 9], rollout_log_probs=[-0.3, -0.2], loss_mask=[1, 1],
                   executors=[1, 1], group_index=1, reward=None)]


def test_from_samples_select_and_pack_keep_every_field_under_one_name():
    batch = StepBatch.from_samples(_samples())
    assert batch.num_samples == 3 and batch.response_lengths == [3, 1, 2] and batch.prompt_id == [0, 0, 1]
    assert batch.rewards == [1.0, 0.0, 0.0] and batch.teacher_log_probs is None
    shard = batch.select([2, 0])
    assert shard.response_lengths == [2, 3] and shard.prompt_id == [1, 0]
    assert [m.tolist() for m in shard.loss_masks] == [[1.0, 1.0], [1.0, 1.0, 0.0]]
    micro_batch = shard.pack()
    assert micro_batch.tokens.tolist() == [7, 8, 9, 1, 2, 3, 4, 5]
    assert micro_batch.layout.prompt_lengths == [1, 2] and micro_batch.sequence_token_counts() == [2, 2]
    assert micro_batch.rollout_log_probs[1].tolist() == pytest.approx([-0.5, -1.0, -2.0])
    plan = plan_micro_batches(batch, dp_size=2, cp_size=1, max_tokens_per_micro_batch=16)
    assert sorted(i for rank in plan for mb in rank for i in mb) == [0, 1, 2]


def test_the_advantage_estimator_reads_the_step_batch_itself():
    batch = StepBatch.from_samples(_samples())
    rollout_data = replace(batch, rewards=torch.tensor(batch.rewards, dtype=torch.float64))
    advantages = get_advantage("grpo")(AlgorithmConfig(), rollout_data)
    assert [a.shape[0] for a in advantages] == [3, 1, 2]
    assert float(advantages[0][0]) > 0 > float(advantages[1][0])  # group 0: reward 1 beats reward 0
    assert rollout_data["prompt_id"] == [0, 0, 1]  # the first API's mapping reads still work


def test_a_step_batch_travels_between_ranks_without_pickle():
    batch = StepBatch.preference_pairs([type("E", (), dict(prompt_ids=[1], chosen_ids=[2, 3], rejected_ids=[4]))()])
    batch.ref_log_probs = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    decoded = decode_message(encode_message(batch))
    assert isinstance(decoded, StepBatch)
    assert decoded.pair_ids == [0, 0] and decoded.is_chosen == [1, 0] and decoded.response_lengths == [2, 1]
    assert [t.tolist() for t in decoded.ref_log_probs] == [[-1.0, -2.0], [-0.5]]


def test_an_agent_episodes_branches_share_its_episode_id_through_the_step_batch():
    """Three samples of one branched episode (episode 4) and one of another: the step batch keeps the
    episode ids across ranks, and Dr. GRPO's group mean counts each episode once."""
    samples = _samples() + [Sample(prompt_ids=[1], response_ids=[2], rollout_log_probs=[-0.1], loss_mask=[1],
                                   executors=[1], group_index=0, reward=0.0)]
    for sample, episode in zip(samples, [4, 4, None, 5]):
        sample.episode_id, sample.group_index, sample.reward = episode, 0, float(episode == 4)
    batch = decode_message(encode_message(StepBatch.from_samples(samples)))
    assert batch.episode_id == [4, 4, None, 5] and batch.select([3, 0]).episode_id == [5, 4]
    rollout_data = replace(batch, rewards=torch.tensor(batch.rewards, dtype=torch.float64))
    advantages = [float(a[0]) for a in get_advantage("dr_grpo")(AlgorithmConfig(), rollout_data)]
    assert advantages == pytest.approx([2 / 3, 2 / 3, -1 / 3, -1 / 3])  # episodes 1, 0, 0: mean 1/3
    assert StepBatch.from_samples(_samples()).episode_id is None      # samples that are their own episodes
