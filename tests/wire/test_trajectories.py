"""The one trajectory builder: generated ids train (mask 1, their log-probs), template ids never do."""

import pytest

from stacx.wire.sample import Executor
from stacx.wire.trajectories import append_generated, append_template, close_turn, empty_sample

EOS = 2


def test_a_turn_is_its_generated_ids_then_the_template_ids_that_close_it_and_follow():
    sample = empty_sample([5, 6], group_index=3)
    append_generated(sample, [7, 8], [-0.5, -0.25])
    close_turn(sample, [7, 8], EOS)
    append_template(sample, [9, 10])
    append_generated(sample, [11, EOS], [-1.0, -2.0], executor=Executor.TEACHER)
    close_turn(sample, [11, EOS], EOS)  # the engine generated the end of turn itself: nothing added

    assert sample.tokens == [5, 6, 7, 8, EOS, 9, 10, 11, EOS]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -2.0]
    assert sample.executors == [1, 1, 0, 0, 0, 2, 2]
    assert sample.group_index == 3


def test_an_empty_reply_is_closed_with_the_end_of_turn_id_untrained():
    sample = empty_sample([5])
    append_generated(sample, [], [])
    close_turn(sample, [], EOS)
    assert (sample.response_ids, sample.loss_mask, sample.executors) == ([EOS], [0], [0])


def test_log_probs_must_match_the_generated_ids():
    with pytest.raises(ValueError, match="1 log-probs for 2 ids"):
        append_generated(empty_sample([5]), [7, 8], [-0.5])
