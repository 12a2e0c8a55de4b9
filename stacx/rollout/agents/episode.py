"""One agent episode, token-in and token-out: the engine's ids plus the chat template's observation ids.

    session = AgentSession(env, task, tokenizer=tok, rng=rng)   # env.reset, prompt rendered with tools
    ids = session.prompt_ids
    for each turn:
        action_ids = engine output ids (ending in eos)            # appended as generated, never re-tokenized
        reply = session.respond(action_ids)                        # tools run / env.step; observation ids
        ids += action_ids + reply.observation_ids

`run_episode` is that loop against engines (one per executor), returning the trained `Sample`;
`stacx.rollout.rollin` drives many sessions in lock-step with batched requests.

Why token-in, token-out: decoding the model's ids and re-tokenizing the text does not give the
same ids back (merges differ across turn boundaries), so the trainer would score tokens the
engine never sampled. Here the response is exactly the engine's ids, turn after turn; only the
text *between* turns is tokenized, and it is the chat template's own rendering of the new
messages after an assistant turn (`stacx.wire.chat_continuation`, the rule the OpenAI
endpoint's sessions use too): the rest of the template's close of that turn after the eos the
engine generated, the observation messages and the next generation prompt. Their content is
encoded with control spellings held back (`stacx.wire.chat_encoding`): a tool result holding
`<|im_end|>\n<|im_start|>assistant` is text, never a forged turn. Those ids get loss mask 0 and
executor ENVIRONMENT.

What the model's reply does: with tools offered (`Environment.tools`), the reply is parsed in the
tokenizer's tool-call format (`stacx.wire.tool_calls`); its calls run (each contained: an error,
a timeout or a bad output becomes the tool message the model reads) and the tool messages are the
observation. A malformed call is answered with an error tool message. A reply without any call
goes to `env.step`, whose reward is the turn's reward. Every turn is counted in `EpisodeCounts`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from stacx.rollout.agents.environments import Environment, Messages, StepResult
from stacx.rollout.dagger import TurnExecutor
from stacx.wire.chat_continuation import ids_after_assistant_turn
from stacx.wire.chat_encoding import chat_ids, decode_reply
from stacx.wire.engine import InferenceEngine
from stacx.wire.sample import Executor, Sample
from stacx.wire.tool_calls import TOOL_CALL_STYLES, ParsedToolCalls, parse_tool_calls, tool_call_style_for
from stacx.wire.trajectories import append_generated, append_template, close_turn, empty_sample
from stacx.wire.types import GenerateRequest, SamplingParams


@dataclass
class EpisodeCounts:
    """What happened in one episode (summed over a step's episodes into `agent/*` metrics)."""

    turns: int = 0
    """Replies the model gave."""
    tool_calls: int = 0
    """Tool calls parsed from the replies."""
    parse_errors: int = 0
    """Tool calls that could not be parsed (each answered with an error message)."""
    tool_errors: int = 0
    """Calls that raised, returned a bad output, named an unknown tool or broke the schema (timeouts apart)."""
    tool_timeouts: int = 0
    """Calls stopped at their time limit."""


@dataclass
class Reply:
    """The environment side of one turn."""

    observation_ids: list[int]
    """The chat template's ids of the observation (empty when the episode ended)."""
    reward: float
    done: bool
    """The environment ended the episode (reaching max_turns is not `done`)."""
    info: dict = field(default_factory=dict)


def as_messages(value, role: str = "user") -> Messages:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


class AgentSession:
    """The environment side of one episode, in token ids (see the module doc)."""

    def __init__(self, environment: Environment, task: dict, *, tokenizer, rng: random.Random,
                 tool_call_style: Optional[str] = None):
        self.environment, self.tokenizer, self.task = environment, tokenizer, task
        self.counts = EpisodeCounts()
        self._closed = False
        self.turn_rewards: list[float] = []
        self.turn_infos: list[dict] = []
        try:  # a session that does not start still releases what `reset` opened
            self.first_messages = as_messages(environment.reset(task, rng))
            specs = environment.tool_specs()
            self.tool_schemas = [spec.schema() for spec in specs] or None
            self.tool_call_style = None
            if specs:
                self.tool_call_style = tool_call_style or environment.tool_call_style or tool_call_style_for(tokenizer)
                if self.tool_call_style not in TOOL_CALL_STYLES:
                    raise ValueError(f"tool_call_style {self.tool_call_style!r} (of {type(environment).__name__} or "
                                     f"the prompt row's metadata) is unknown; known styles: {list(TOOL_CALL_STYLES)}")
            self.prompt_ids = chat_ids(tokenizer, self.first_messages, tools=self.tool_schemas)
        except BaseException:
            self.close()
            raise

    def respond(self, action_ids: Sequence[int], *, last_turn: bool = False) -> Reply:
        """Answer the model's reply `action_ids`; `last_turn`: no further action follows, so no observation.

        Three steps, which a batched caller may split: `read` and `reply` touch the tokenizer (one
        thread at a time: a fast tokenizer's settings are shared state), `act` runs the tools or
        `step` and may run concurrently with other sessions' `act`."""
        return self.reply(self.act(self.read(action_ids)), last_turn=last_turn)

    def read(self, action_ids: Sequence[int]) -> Union[str, ParsedToolCalls]:
        """The reply's text without its end-of-turn token; parsed when the environment offers tools."""
        self.counts.turns += 1
        text = decode_reply(self.tokenizer, action_ids)
        if self.tool_call_style is None:
            return text
        parsed = parse_tool_calls(text, self.tool_call_style)
        return parsed if parsed.calls or parsed.errors else parsed.content

    def act(self, reply: Union[str, ParsedToolCalls]) -> StepResult:
        """The environment's answer: tool messages for the calls (and errors) of a parsed reply, else `step`."""
        if isinstance(reply, str):
            return self.environment.step(reply)
        messages = []
        self.counts.parse_errors += len(reply.errors)
        for error in reply.errors:
            messages.append({"role": "tool", "name": "error", "content": f"error: could not parse the tool call: {error}"})
        for call in reply.calls:
            self.counts.tool_calls += 1
            result = self.environment.call_tool(call)
            if result.error == "timeout":
                self.counts.tool_timeouts += 1
            elif result.error is not None:
                self.counts.tool_errors += 1
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call.call_id, "content": result.content})
        ending = self.environment.episode_end()
        if ending is not None:
            return dataclasses.replace(ending, done=True)
        return StepResult(messages, 0.0, False)

    def reply(self, result: StepResult, *, last_turn: bool) -> Reply:
        """The turn's reward and end, and the observation's ids unless no action follows."""
        self.turn_rewards.append(float(result.reward))
        # Kept with the sample and dumped to rollouts.jsonl: a value JSON cannot hold is kept as its repr.
        self.turn_infos.append(json.loads(json.dumps(dict(result.info), default=repr)))
        if result.done or last_turn:  # no action follows: no observation to show
            return Reply([], float(result.reward), bool(result.done), dict(result.info))
        return Reply(self.observation_ids(as_messages(result.observation)), float(result.reward), False,
                     dict(result.info))

    def observation_ids(self, messages: Messages) -> list[int]:
        """The chat template's ids for `messages` after an assistant turn that ended on eos, through the
        next generation prompt (`stacx.wire.chat_continuation`)."""
        ids = ids_after_assistant_turn(self.tokenizer, self.first_messages, messages, tools=self.tool_schemas,
                                       generated_ids=[self.tokenizer.eos_token_id])
        if ids is None:
            raise ValueError(
                f"the tokenizer's chat template does not end an assistant turn with the eos token "
                f"{self.tokenizer.eos_token!r}, or renders earlier messages differently once more follow; multi-turn "
                "episodes need a template whose rendering of a conversation is a prefix of its rendering of the "
                "longer conversation (set the checkpoint's chat_template, or its eos_token to the end-of-turn token)")
        return ids

    def close(self) -> None:
        """The episode is over: the environment releases its resources (once; later calls do nothing)."""
        if not self._closed:
            self._closed = True
            self.environment.close()

    def record(self, sample: Sample) -> None:
        """Keep the episode's counts, per-turn rewards and per-turn `info` in `sample.metadata['episode']`."""
        sample.metadata["episode"] = {**dataclasses.asdict(self.counts), "turn_rewards": list(self.turn_rewards),
                                      "turn_infos": list(self.turn_infos)}


def append_action(sample: Sample, executor: Executor, output, eos: int) -> tuple[int, int]:
    """Add one engine output as generated; an action that did not end in eos gets one (mask 0) to
    close the turn (stacx.wire.trajectories). Teacher tokens carry log-prob 0.0 (the trainer recomputes
    the student's). Returns the action's [start, end) in `sample.response_ids`."""
    action = list(output.output_ids)
    log_probs = list(output.output_log_probs) if executor == Executor.STUDENT else [0.0] * len(action)
    start = len(sample.response_ids)
    append_generated(sample, action, log_probs, executor=executor)
    close_turn(sample, action, eos)
    sample.metadata.setdefault("turn_executors", []).append(executor.name.lower())
    return start, len(sample.response_ids)


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
    tool_call_style: Optional[str] = None,
) -> Sample:
    """Play one episode; the Sample's reward is the sum of turn rewards, its metadata['episode'] the counts."""
    session = AgentSession(env, task, tokenizer=tokenizer, rng=rng, tool_call_style=tool_call_style)
    try:
        return _play(session, tokenizer=tokenizer, engines=engines, turn_executor=turn_executor, sampling=sampling,
                     max_turns=max_turns, rng=rng)
    finally:
        session.close()


def _play(session: AgentSession, *, tokenizer, engines, turn_executor, sampling, max_turns, rng) -> Sample:
    task = session.task
    sample = empty_sample(session.prompt_ids, metadata={"task": task, "turn_executors": []})
    total_reward, finish = 0.0, "length"
    for turn in range(max_turns):
        executor = Executor(turn_executor(turn))
        if executor not in engines:
            raise ValueError(f"turn {turn}: no engine for executor {executor.name}; have {[e.name for e in engines]}")
        request = GenerateRequest(input_ids=tuple(sample.tokens),
                                  sampling=dataclasses.replace(sampling, seed=rng.randrange(2**31)))
        (output,) = engines[executor].generate([request])
        start, end = append_action(sample, executor, output, tokenizer.eos_token_id)
        reply = session.respond(sample.response_ids[start:end], last_turn=turn == max_turns - 1)
        total_reward += reply.reward
        if reply.done:
            finish = "stop"
            break
        if turn == max_turns - 1:
            break
        append_template(sample, reply.observation_ids)
    session.record(sample)
    sample.reward, sample.finish_reason = total_reward, finish
    sample.response_text = tokenizer.decode(sample.response_ids, skip_special_tokens=False)
    return sample


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """agent/* metrics of a step's environment episodes ({} when there are none): episodes, turns per
    episode, tool calls, parse errors, tool errors and tool timeouts (sums over the step), and the
    mean per-turn reward."""
    counts = [s.metadata["episode"] for s in samples if isinstance(s.metadata.get("episode"), dict)]
    if not counts:
        return {}
    turn_rewards = [r for c in counts for r in c["turn_rewards"]]
    metrics = {"agent/episodes": float(len(counts)),
               "agent/turns_mean": sum(c["turns"] for c in counts) / len(counts),
               "agent/turn_reward_mean": sum(turn_rewards) / max(1, len(turn_rewards))}
    for name in ("tool_calls", "parse_errors", "tool_errors", "tool_timeouts"):
        metrics[f"agent/{name}"] = float(sum(c[name] for c in counts))
    return metrics
