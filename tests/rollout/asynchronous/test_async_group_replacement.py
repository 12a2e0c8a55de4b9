"""`--rollout-mode async` replaces a group with a dropped member by a fresh prompt instead of stopping (issue 44):
the batch keeps its size, the groups are complete, the replacement is counted, and too many drops still stop the
run naming the cause. In-process: the scripted engine of the async loop tests, a reward service that is down for
one prompt; with --max-staleness 0 exactly one batch of groups is admitted before the first take, so the counts
do not depend on thread timing."""

from __future__ import annotations

import pytest

from stacx.rollout.asynchronous.async_rollout import AsyncRollout
from stacx.rollout.asynchronous.group_replacement import GroupReplacements
from stacx.rollout.data import Example
from stacx.rollout.episode_retry import EpisodeLossError, InfrastructureError
from stacx.rollout.service import RolloutService
from stacx.trainer.config.run import RunConfig
from tests.trainer.fakes import make_trainer
from tests.trainer.test_loop_async import TOKENIZER, Prompts, ScriptedEngine


def judge(response: str, label, metadata: dict) -> float:
    if label == "judge down":
        raise InfrastructureError("reward", "the judge service did not answer")
    return 1.0


class LabelledPrompts(Prompts):
    def __init__(self, labels):
        super().__init__(2)
        self.examples = [Example(prompt_ids=[5 + i, 6, 7], source=f"rows.jsonl:{i}", label=label, metadata={})
                         for i, label in enumerate(labels)]


def producer_of(labels, **settings):
    config = RunConfig.from_dict({"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 3,
                                  "max_staleness": 0, "rollout_mode": "async", "save_rollouts_per_step": 0,
                                  "reward_fn": f"{__name__}:judge", "episode_retries": 0, **settings})
    service = RolloutService(ScriptedEngine(), engine_kind="cpu", url="scripted", tokenizer=TOKENIZER,
                             rollout_section=config.rollout)
    trainer = make_trainer("grpo", run_config=config, rollout=service, data=LabelledPrompts(labels))
    producer = AsyncRollout(service, LabelledPrompts(labels), trainer.step_rollout, rollout_section=config.rollout,
                            start_version=0)
    return producer, service


def test_a_group_whose_reward_call_failed_is_replaced_by_the_next_prompt_and_counted():
    producer, service = producer_of(["ok", "judge down", "ok", "ok", "ok", "ok"], max_dropped_fraction=0.5)
    producer.start()
    try:
        samples, metrics = producer.take_batch(0)
    finally:
        producer.close()
        service.close()
    assert sorted({s.metadata["prompt_index"] for s in samples}) == [0, 2]  # prompt 1's group played prompt 2
    assert len(samples) == 4 and all(s.reward == 1.0 and not s.reward_error for s in samples)
    assert sorted(s.group_index for s in samples) == [0, 0, 1, 1]  # two complete groups of two
    assert metrics["rollout/groups_replaced"] == 1.0 and metrics["rollout/episodes_dropped"] == 2.0
    assert producer.replacements.total_replaced == 1


def test_too_many_dropped_episodes_stop_the_run_naming_the_cause():
    producer, service = producer_of(["ok", "judge down", "ok", "ok", "ok", "ok"])  # 2 of 6 > 0.25
    producer.start()
    try:
        with pytest.raises(EpisodeLossError, match=r"2 of 6 episodes were dropped.*--max-dropped-fraction 0.25.*"
                                                   r"judge service did not answer"):
            producer.take_batch(0)
    finally:
        producer.close()
        service.close()


def test_a_group_that_keeps_losing_episodes_stops_the_run():
    producer, service = producer_of(["judge down"] * 6, max_dropped_fraction=1.0)
    producer.start()
    try:
        with pytest.raises(RuntimeError, match=r"asynchronous rollout failed: prompt row rows.jsonl:\d: a group lost "
                                               r"an episode 5 times in a row.*judge service"):
            producer.take_batch(0)
    finally:
        producer.close()
        service.close()


def test_the_counts_are_per_batch_and_an_episode_failure_counts_its_episodes():
    replacements = GroupReplacements(max_dropped_fraction=0.5)
    assert replacements.played([object(), object()], ["sandbox: server gone"]) == ["sandbox: server gone"]
    replacements.replaced()
    assert replacements.take_metrics(0) == {"rollout/groups_replaced": 1.0, "rollout/episodes_dropped": 1.0}
    assert replacements.take_metrics(1) == {"rollout/groups_replaced": 0.0, "rollout/episodes_dropped": 0.0}
