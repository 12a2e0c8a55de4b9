"""What a user sees of an --agent run (no server: each episode's samples are given): rollouts.jsonl with each
episode's turns and reward, the uniform-reward warning, and a reward mean over episodes, not samples."""

from __future__ import annotations

import json
import logging

from stacx.rollout.agents.agent_rollout import AgentRollout
from stacx.rollout.evaluation import RolloutDumper
from stacx.rollout.step_rollout import uniform_reward_warning
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.wire.sample import Sample

TOKENIZER = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789<>=+ ")


def _episode_sample(task: int, episode: int, reward: float, reply: str = "call<add>", observation: str = "=5") -> Sample:
    """An agent episode's branch: the model's call, the tool's answer, the model's final answer."""
    parts = [(reply, 1), (observation, 0), ("5", 1)]
    ids = [token for text, _ in parts for token in TOKENIZER.encode(text, add_special_tokens=False)]
    mask = [flag for text, flag in parts for _ in TOKENIZER.encode(text, add_special_tokens=False)]
    return Sample(prompt_ids=TOKENIZER.encode("2+3", add_special_tokens=False), response_ids=ids,
                  rollout_log_probs=[0.0] * len(ids), loss_mask=mask, executors=mask, group_index=task,
                  episode_id=episode, reward=reward, metadata={"num_turns": 2, "session_id": f"s{episode}",
                                                                "task": {"prompt": "2+3"}})


def _rollout(episodes: dict[int, list[Sample]], tmp_path, **kwargs) -> AgentRollout:
    rollout = AgentRollout(lambda base_url, task: 1.0, server_url="http://unused", n_samples_per_task=2,
                           next_tasks=lambda step: [{"prompt": "2+3"}, {"prompt": "1+1"}], **kwargs)
    rollout.run_episode = lambda group_index, task, *, episode_id: episodes[episode_id]
    return rollout


def test_an_agent_run_dumps_each_episodes_turns_and_reward(tmp_path):
    episodes = {0: [_episode_sample(0, 0, 1.0)], 1: [_episode_sample(0, 1, 0.0)], 2: [_episode_sample(1, 2, 1.0)],
                3: [_episode_sample(1, 3, 0.0)]}
    dumper = RolloutDumper(str(tmp_path), per_step=4, tokenizer=TOKENIZER)
    _rollout(episodes, tmp_path, dumper=dumper).collect(0)
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [row["reward"] for row in rows] == [1.0, 0.0, 1.0, 0.0] and rows[0]["step"] == 0
    assert rows[0]["turns"] == [{"role": "model", "text": "call<add>"}, {"role": "observation", "text": "=5"},
                                {"role": "model", "text": "5"}]
    assert rows[0]["response_text"] == "call<add>=55" and rows[0]["metadata"]["session_id"] == "s0"


def test_the_uniform_reward_warning_fires_for_agent_runs_once(tmp_path, caplog):
    episodes = {index: [_episode_sample(index // 2, index, 0.0)] for index in range(4)}

    def warning(step, samples):
        return uniform_reward_warning(step, samples, n_samples_per_prompt=2, temperature=1.0, reward_fn="none")

    rollout = _rollout(episodes, tmp_path, uniform_reward_warning=warning)
    with caplog.at_level(logging.WARNING):
        rollout.collect(0)
        rollout.collect(1)
    warned = [record.getMessage() for record in caplog.records if "rewards are identical" in record.getMessage()]
    assert len(warned) == 1 and "an agent whose episodes all earn the same reward" in warned[0]


def test_the_reward_mean_is_over_episodes_however_often_one_branched(tmp_path):
    # Episode 0 (reward 1) branched into three samples; episodes 1-3 earned 0: the mean over episodes is 1/4,
    # the mean over samples would be 3/6.
    episodes = {0: [_episode_sample(0, 0, 1.0) for _ in range(3)], 1: [_episode_sample(0, 1, 0.0)],
                2: [_episode_sample(1, 2, 0.0)], 3: [_episode_sample(1, 3, 0.0)]}
    _, metrics = _rollout(episodes, tmp_path).collect(0)
    assert metrics["rollout/reward_mean"] == 0.25 and metrics["rollout/agent_samples"] == 6.0
