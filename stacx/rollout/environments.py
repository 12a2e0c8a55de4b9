"""Multi-turn environments and the agent loop that records who produced every token.

An environment is a text game: `reset(task, rng)` gives the first observation, `step(action)`
answers with (observation, reward, done). `run_episode` alternates model turns and
observations in the tokenizer's chat format:

    prompt   = chat([user: obs_0]) + "<|assistant|>"              (the sample's prompt_ids)
    response = action_0 <eos> chat([user: obs_1]) "<|assistant|>" action_1 <eos> ...

Only action tokens are trained on (loss_mask 1); observations and chat markup get loss_mask 0
and executor ENVIRONMENT. Each turn's executor (student or teacher engine) comes from a
roll-in plan (stacx.rollout.dagger); a student-only rollout uses `lambda turn: STUDENT`.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Mapping

from stacx.rollout.dagger import Executor, TurnExecutor
from stacx.rollout.engines.base import InferenceEngine
from stacx.rollout.manager import Sample
from stacx.rollout.tokenizer import apply_chat_template
from stacx.rollout.types import GenerateRequest, SamplingParams


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool


class Environment(abc.ABC):
    """One episode of a text game; a fresh instance (or `reset`) per episode."""

    @abc.abstractmethod
    def reset(self, task: dict, rng: random.Random) -> str:
        """Start an episode for `task`; return the first observation."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's action text; return the next observation, the reward and whether it ended."""


class GuessNumberEnvironment(Environment):
    """Guess a hidden digit 0-9; after each guess the environment says higher, lower or correct.

    Reward 1.0 on the turn the guess is correct (the episode ends), 0.0 otherwise. task['target']
    fixes the digit; without it the digit is drawn from rng.
    """

    def reset(self, task: dict, rng: random.Random) -> str:
        self.target = int(task["target"]) if "target" in task else rng.randint(0, 9)
        return "guess a digit"

    def step(self, action: str) -> StepResult:
        digits = [c for c in action if c.isdigit()]
        if not digits:
            return StepResult("say a digit", 0.0, False)
        guess = int(digits[0])
        if guess == self.target:
            return StepResult("correct", 1.0, True)
        return StepResult("higher" if guess < self.target else "lower", 0.0, False)


def run_episode(
    env: Environment,
    task: dict,
    *,
    tokenizer,
    engines: Mapping[Executor, InferenceEngine],
    turn_executor: TurnExecutor,
    sampling: SamplingParams,
    max_turns: int,
    rng: random.Random,
) -> Sample:
    """Play one episode; returns a Sample whose reward is the sum of step rewards."""
    eos = tokenizer.eos_token_id
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": env.reset(task, rng)}])
    sample = Sample(prompt_ids=list(prompt), response_ids=[], rollout_log_probs=[], loss_mask=[], executors=[],
                    metadata={"task": task, "turn_executors": []})
    total_reward, finish = 0.0, "length"
    for turn in range(max_turns):
        executor = Executor(turn_executor(turn))
        if executor not in engines:
            raise ValueError(f"turn {turn}: no engine for executor {executor.name}; have {[e.name for e in engines]}")
        sample.metadata["turn_executors"].append(executor.name.lower())
        request = GenerateRequest(input_ids=tuple(sample.tokens),
                                  sampling=SamplingParams(**{**sampling.__dict__, "seed": rng.randrange(2**31)}))
        (output,) = engines[executor].generate([request])
        action_ids = list(output.output_ids)
        if not action_ids or action_ids[-1] != eos:
            action_ids.append(eos)  # close the turn so the next observation starts cleanly
            log_probs = list(output.output_log_probs) + [0.0]
            mask = [1] * len(output.output_ids) + [0]
        else:
            log_probs, mask = list(output.output_log_probs), [1] * len(action_ids)
        if executor == Executor.TEACHER:
            log_probs = [0.0] * len(action_ids)  # the student's log-probs there are recomputed by the trainer
        sample.response_ids += action_ids
        sample.rollout_log_probs += log_probs
        sample.loss_mask += mask
        sample.executors += [int(executor) if m else int(Executor.ENVIRONMENT) for m in mask]
        result = env.step(tokenizer.decode(action_ids, skip_special_tokens=True))
        total_reward += result.reward
        if result.done:
            finish = "stop"
            break
        if turn == max_turns - 1:
            break  # no further action would follow the observation
        observation = apply_chat_template(tokenizer, [{"role": "user", "content": result.observation}])
        sample.response_ids += observation
        sample.rollout_log_probs += [0.0] * len(observation)
        sample.loss_mask += [0] * len(observation)
        sample.executors += [int(Executor.ENVIRONMENT)] * len(observation)
    sample.reward, sample.finish_reason = total_reward, finish
    sample.response_text = tokenizer.decode(sample.response_ids, skip_special_tokens=False)
    return sample
