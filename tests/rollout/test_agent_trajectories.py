"""Recorded turns -> samples: the engine's ids, the template's ids between turns, masks and versions."""

import pytest

from stacx.rollout.agent_trajectories import RecordedTurn, assemble_trajectories
from stacx.rollout.dagger import Executor


def turn(prompt, output, version=0, finish="stop"):
    return RecordedTurn(prompt_ids=tuple(prompt), output_ids=tuple(output),
                        output_log_probs=tuple(-0.1 * (i + 1) for i in range(len(output))),
                        weight_version=version, finish_reason=finish)


def test_continuing_turns_join_into_one_sample_with_mask_one_on_generated_ids_only():
    first = turn([5, 6, 7], [20, 21, 1], version=3)
    second = turn([5, 6, 7, 20, 21, 1, 8, 9], [22, 1], version=2)            # B_1 = [8, 9] from the template
    third = turn([5, 6, 7, 20, 21, 1, 8, 9, 22, 1, 10], [23], version=4, finish="length")
    (sample,) = assemble_trajectories([first, second, third], group_index=7)
    assert sample.prompt_ids == [5, 6, 7]
    assert sample.response_ids == [20, 21, 1, 8, 9, 22, 1, 10, 23]
    assert sample.tokens == list(third.prompt_ids + third.output_ids)
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert sample.rollout_log_probs == [*first.output_log_probs, 0.0, 0.0, *second.output_log_probs, 0.0,
                                        *third.output_log_probs]
    assert sample.executors == [int(Executor.STUDENT)] * 3 + [int(Executor.ENVIRONMENT)] * 2 \
        + [int(Executor.STUDENT)] * 2 + [int(Executor.ENVIRONMENT), int(Executor.STUDENT)]
    assert (sample.weight_version, sample.group_index, sample.finish_reason) == (2, 7, "length")
    # the last turn's output ([23]) starts at response index 8: what a reward of the final answer reads
    assert sample.metadata == {"num_turns": 3, "turn_weight_versions": [3, 2, 4], "last_turn_start": 8}


def test_a_rewritten_history_starts_a_new_sample():
    first = turn([5, 6], [20, 1])
    rewritten = turn([5, 9, 9], [21, 1])          # does not start with [5, 6, 20, 1]
    after = turn([5, 9, 9, 21, 1, 4], [22])
    samples = assemble_trajectories([first, rewritten, after])
    assert [s.tokens for s in samples] == [[5, 6, 20, 1], [5, 9, 9, 21, 1, 4, 22]]
    assert [s.loss_mask for s in samples] == [[1, 1], [1, 1, 0, 1]]
    assert assemble_trajectories([]) == []


def test_recorded_turns_round_trip_through_json_and_refuse_misaligned_log_probs():
    original = turn([1, 2], [3, 4], version=5)
    assert RecordedTurn.from_json(original.to_json()) == original
    with pytest.raises(ValueError, match="1 output_log_probs for 2 output_ids"):
        RecordedTurn(prompt_ids=(1,), output_ids=(2, 3), output_log_probs=(0.0,), weight_version=0)
