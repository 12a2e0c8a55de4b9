"""Recorded turns -> samples: the engine's ids, the template's ids between turns, masks and versions."""

import pytest

from stacx.rollout.agents.agent_trajectories import assemble_trajectories, branch_metrics
from stacx.wire.sample import Executor
from stacx.wire.trajectories import RecordedTurn


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
    assert sample.metadata == {"num_turns": 3, "turn_weight_versions": [3, 2, 4], "last_turn_start": 8,
                               "branch_of": None, "branch_point": 0}


def test_a_rewritten_history_starts_a_branch_of_the_same_episode():
    first = turn([5, 6], [20, 1])
    rewritten = turn([5, 9, 9], [21, 1])          # does not start with [5, 6, 20, 1]
    after = turn([5, 9, 9, 21, 1, 4], [22])
    samples = assemble_trajectories([first, rewritten, after], group_index=3, episode_id=11)
    assert [s.tokens for s in samples] == [[5, 6, 20, 1], [5, 9, 9, 21, 1, 4, 22]]
    assert [s.loss_mask for s in samples] == [[1, 1], [1, 1, 0, 1]]
    assert [(s.metadata["branch_of"], s.metadata["branch_point"]) for s in samples] == [(None, 0), (0, 1)]
    assert [(s.group_index, s.episode_id) for s in samples] == [(3, 11), (3, 11)]
    assert assemble_trajectories([]) == []


def generated(samples):
    """Every id trained on (loss mask 1), per sample."""
    return [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in samples]


def test_a_retry_after_a_format_error_is_a_branch_from_the_common_prefix_and_each_output_is_trained_once():
    """The scaffold drops its malformed reply, appends the format error and asks again; then goes on."""
    system_task = [1, 2, 3, 4]                    # system + task, then the generation prompt 9
    bad = turn(system_task + [9], [30, 31, 0])
    retry = turn(system_task + [7, 7, 9], [32, 0])            # the error message [7, 7], no bad reply
    then = turn(system_task + [7, 7, 9, 32, 0, 8, 9], [33, 0])  # continues the retry
    samples = assemble_trajectories([bad, retry, then], group_index=2, episode_id=5)
    assert [s.tokens for s in samples] == [list(bad.prompt_ids + bad.output_ids),
                                           list(then.prompt_ids + then.output_ids)]
    assert samples[1].prompt_ids == list(retry.prompt_ids)
    assert samples[1].loss_mask == [1, 1, 0, 0, 1, 1]
    assert generated(samples) == [[30, 31, 0], [32, 0, 33, 0]]
    assert samples[1].metadata["branch_of"] == 0 and samples[1].metadata["branch_point"] == len(system_task)
    assert samples[1].metadata["num_turns"] == 2 and samples[1].metadata["last_turn_start"] == 4
    assert branch_metrics([samples]) == {"rollout/agent_branches_per_episode": 1.0,
                                         "rollout/agent_tokens_reprefilled": 4.0}


def test_a_compacted_history_branches_and_later_turns_continue_the_compacted_path():
    first = turn([1, 2, 9], [40, 0])
    second = turn([1, 2, 9, 40, 0, 5, 9], [41, 0])
    compacted = turn([1, 2, 60, 61, 9], [42, 0])               # the history replaced by a summary [60, 61]
    after = turn([1, 2, 60, 61, 9, 42, 0, 6, 9], [43])
    samples = assemble_trajectories([first, second, compacted, after])
    assert [s.metadata["num_turns"] for s in samples] == [2, 2]
    assert generated(samples) == [[40, 0, 41, 0], [42, 0, 43]]
    assert samples[1].metadata["branch_point"] == 2
    assert branch_metrics([samples, [], samples[:1]]) == {"rollout/agent_branches_per_episode": 0.5,
                                                          "rollout/agent_tokens_reprefilled": 2.0}


def test_interleaved_sub_agent_turns_each_continue_their_own_path_not_the_last_turn():
    main, sub = turn([1, 2, 9], [40, 0]), turn([1, 3, 9], [50, 0])
    main_next = turn([1, 2, 9, 40, 0, 5, 9], [41, 0])        # continues `main`, recorded after `sub`
    sub_next = turn([1, 3, 9, 50, 0, 5, 9], [51, 0])
    repeat = turn([1, 2, 9, 40, 0, 5, 9], [44, 0])           # the same request again: a branch at its whole prompt
    samples = assemble_trajectories([main, sub, main_next, sub_next, repeat])
    assert generated(samples) == [[40, 0, 41, 0], [50, 0, 51, 0], [44, 0]]
    assert [(s.metadata["branch_of"], s.metadata["branch_point"]) for s in samples] == [(None, 0), (0, 1), (0, 7)]


def test_recorded_turns_round_trip_through_json_and_refuse_misaligned_log_probs():
    original = turn([1, 2], [3, 4], version=5)
    assert RecordedTurn.from_json(original.to_json()) == original
    with pytest.raises(ValueError, match="1 output_log_probs for 2 output_ids"):
        RecordedTurn(prompt_ids=(1,), output_ids=(2, 3), output_log_probs=(0.0,), weight_version=0)
