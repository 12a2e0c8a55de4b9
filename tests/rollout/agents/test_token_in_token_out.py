"""Zero drift: the trained ids are the engine's ids turn by turn plus the chat template's observation
ids, in the Qwen and Llama 3 formats; tool failures inside an episode are observations, counted."""

from __future__ import annotations

import random
import threading

import pytest

from stacx.rollout import rollin
from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
from stacx.rollout.agents.environments import ENVIRONMENTS, Environment, StepResult, register_environment
from stacx.rollout.agents.episode import episode_metrics, run_episode
from stacx.rollout.agents.tools import TOOLS, register_tool
from stacx.rollout.data import Example
from stacx.wire.sample import Executor
from stacx.wire.tool_calls import parse_tool_calls
from stacx.wire.types import SamplingParams
from tests.rollout.agents.agent_fixtures import ScriptedEngine

CALL = '{"name": "calculator", "arguments": {"expression": "3*4"}}'


def _chars(tokenizer, text: str) -> list[int]:
    """`text` one character per token, as a model may emit it (never merged into a marker token)."""
    return [tokenizer.convert_tokens_to_ids(ch) for ch in text]


def _special(tokenizer, token: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(token)]


def _qwen_turns(tok) -> list[list[int]]:
    eos = [tok.eos_token_id]
    return [
        _special(tok, "<tool_call>") + _chars(tok, "\n" + CALL + "\n") + _special(tok, "</tool_call>") + eos,
        _chars(tok, '<tool_call>{"name": "calculator"</tool_call>') + eos,  # markers spelled out; bad JSON
        _chars(tok, "the answer is 12") + eos,
    ]


def _llama3_turns(tok) -> list[list[int]]:
    call = '{"name": "calculator", "parameters": {"expression": "3*4"}}'
    return [_chars(tok, "<|python_tag|>" + call) + [tok.eos_token_id],  # the tag spelled out
            _chars(tok, "12") + [tok.eos_token_id]]


def _action_runs(sample) -> list[list[int]]:
    """The response's maximal runs of loss-mask-1 tokens (the model's actions)."""
    runs, previous = [], 0
    for token, mask in zip(sample.response_ids, sample.loss_mask):
        if mask:
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = mask
    return runs


@pytest.mark.parametrize("style, turns_of", [("qwen", _qwen_turns), ("llama3", _llama3_turns)])
def test_trained_ids_are_the_engines_ids_turn_by_turn(style, turns_of):
    tok = build_tool_chat_tokenizer(style)
    turns = turns_of(tok)
    engine = ScriptedEngine(log_prob=-0.25, turns=turns)
    sample = run_episode(ENVIRONMENTS.get("calculator")(), {"expression": "3*4"}, tokenizer=tok,
                         engines={Executor.STUDENT: engine}, turn_executor=lambda t: Executor.STUDENT,
                         sampling=SamplingParams(max_new_tokens=64), max_turns=4, rng=random.Random(0))
    # Each request is exactly the trajectory so far; each action is exactly the engine's output.
    assert len(engine.inputs) == len(turns)
    tokens = sample.prompt_ids + sample.response_ids
    for turn, (request_ids, output_ids) in enumerate(zip(engine.inputs, turns)):
        assert tokens[:len(request_ids)] == request_ids, turn
        assert tokens[len(request_ids):len(request_ids) + len(output_ids)] == output_ids, turn
    assert _action_runs(sample) == turns
    # Re-tokenizing a decoded action would not give the engine's ids back (markers merge): not a trivial check.
    assert any(tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids for ids in turns)
    # Model tokens only are trained on; everything else is the environment's (prompt excluded: never trained).
    assert sample.executors == [int(Executor.STUDENT) if m else int(Executor.ENVIRONMENT) for m in sample.loss_mask]
    assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(sample.rollout_log_probs, sample.loss_mask))
    assert sum(sample.loss_mask) == sum(len(t) for t in turns)
    # The whole trajectory reads as the chat template's rendering of the conversation.
    assert "<tool_call>" in tok.decode(sample.response_ids) or style == "llama3"
    observation = tok.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert "12" in observation  # the calculator's answer reached the model
    counts = sample.metadata["episode"]
    assert (sample.reward, sample.finish_reason) == (1.0, "stop")
    if style == "qwen":
        assert (counts["turns"], counts["tool_calls"], counts["parse_errors"]) == (3, 1, 1)
        assert "could not parse the tool call" in observation and counts["turn_rewards"] == [0.0, 0.0, 1.0]
        assert counts["turn_infos"] == [{}, {}, {"expected": "12"}]
    else:
        assert (counts["turns"], counts["tool_calls"], counts["parse_errors"]) == (2, 1, 0)
        assert "<|start_header_id|>ipython<|end_header_id|>" in tok.decode(sample.response_ids)


def test_observation_ids_are_the_templates_rendering_of_the_conversation():
    tok = build_tool_chat_tokenizer("qwen")
    turns = _qwen_turns(tok)
    sample = run_episode(ENVIRONMENTS.get("calculator")(), {"expression": "3*4"}, tokenizer=tok,
                         engines={Executor.STUDENT: ScriptedEngine(log_prob=-0.25, turns=turns)}, turn_executor=lambda t: Executor.STUDENT,
                         sampling=SamplingParams(), max_turns=4, rng=random.Random(0))
    env = ENVIRONMENTS.get("calculator")()
    texts = [tok.decode(ids[:-1]) for ids in turns]  # each reply without its end-of-turn token
    (parse_error,) = parse_tool_calls(texts[1], "hermes").errors
    messages = env.reset({"expression": "3*4"}, random.Random(0)) + [
        {"role": "assistant", "content": texts[0]}, {"role": "tool", "content": "12"},
        {"role": "assistant", "content": texts[1]},
        {"role": "tool", "content": f"error: could not parse the tool call: {parse_error}"},
        {"role": "assistant", "content": texts[2]}]
    rendered = tok.apply_chat_template(messages, tools=[t.schema() for t in env.tool_specs()], tokenize=False)
    assert tok.decode(sample.prompt_ids + sample.response_ids) == rendered


def test_tool_failures_inside_an_episode_are_counted_and_the_run_goes_on():
    release = threading.Event()  # set at the end, so the abandoned call's thread ends with the test

    @register_tool(timeout_s=0.2)
    def flaky_under_test(mode: str) -> str:
        """Fails on demand."""
        if mode == "raise":
            raise KeyError("no such row")
        if mode == "hang":
            release.wait(30)
        return "ok"

    @register_environment("flaky_under_test")
    class FlakyEnvironment(Environment):
        tools = ("flaky_under_test",)

        def reset(self, task, rng):
            return "use the tool"

        def step(self, action):
            return StepResult("", 0.5, True, info={"handle": object(), "attempts": 2})

    tok = build_tool_chat_tokenizer("qwen")
    eos = [tok.eos_token_id]

    def call(mode):
        return _chars(tok, f'<tool_call>{{"name": "flaky_under_test", "arguments": {{"mode": "{mode}"}}}}</tool_call>')

    turns = [call("raise") + call("hang") + eos, call("fine") + _chars(tok, '<tool_call>{"name": "nope"}</tool_call>') + eos,
             _chars(tok, "done") + eos]
    try:
        sample = run_episode(FlakyEnvironment(), {}, tokenizer=tok, engines={Executor.STUDENT: ScriptedEngine(log_prob=-0.25, turns=turns)},
                             turn_executor=lambda t: Executor.STUDENT, sampling=SamplingParams(), max_turns=5,
                             rng=random.Random(0))
    finally:
        release.set()
        ENVIRONMENTS.unregister("flaky_under_test")
        TOOLS.unregister("flaky_under_test")
    counts = sample.metadata["episode"]
    assert {k: counts[k] for k in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_errors")} == {
        "turns": 3, "tool_calls": 4, "tool_errors": 2, "tool_timeouts": 1, "parse_errors": 0}
    observation = tok.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert "KeyError: 'no such row'" in observation and "did not answer within 0.2 s" in observation
    assert "unknown tool 'nope'" in observation and "\nok\n" in observation
    assert sample.reward == 0.5 and sample.finish_reason == "stop"
    assert counts["turn_infos"][-1]["attempts"] == 2 and counts["turn_infos"][-1]["handle"].startswith("<object")
    metrics = episode_metrics([sample, sample])
    assert metrics["agent/tool_timeouts"] == 2.0 and metrics["agent/turns_mean"] == 3.0
    assert metrics["agent/turn_reward_mean"] == pytest.approx(0.5 / 3)


def test_the_batched_roll_in_plays_the_same_episode_as_run_episode():
    tok = build_tool_chat_tokenizer("qwen")
    turns = _qwen_turns(tok)
    alone = run_episode(ENVIRONMENTS.get("calculator")(), {"expression": "3*4", "label": "12"}, tokenizer=tok,
                        engines={Executor.STUDENT: ScriptedEngine(log_prob=-0.25, turns=turns)}, turn_executor=lambda t: Executor.STUDENT,
                        sampling=SamplingParams(), max_turns=4, rng=random.Random(0))
    example = Example(prompt_ids=[5], source="rows.jsonl:1", label="12",
                      metadata={"environment": "calculator", "max_turns": 4, "expression": "3*4"})
    rng = random.Random(0)
    episodes = rollin.start_episodes([example], n_samples_per_prompt=1, spec=rollin.RollInSpec("student"),
                                     iteration=0, rng=rng, tokenizer=tok)
    rollin.run_turns(episodes, engines={Executor.STUDENT: ScriptedEngine(log_prob=-0.25, turns=turns)}, sampling=SamplingParams(),
                     tokenizer=tok, rng=rng)
    batched = episodes[0].sample
    assert (batched.prompt_ids, batched.response_ids, batched.loss_mask, batched.executors) == (
        alone.prompt_ids, alone.response_ids, alone.loss_mask, alone.executors)
    assert batched.reward == 1.0 and batched.metadata["episode"] == alone.metadata["episode"]
    bad = Example(prompt_ids=[5], source="rows.jsonl:2", metadata={"environment": "calculator", "max_turns": 2})
    with pytest.raises(ValueError, match=r"prompt row rows.jsonl:2: .*missing required field 'expression'"):
        rollin.start_episodes([bad], n_samples_per_prompt=1, spec=rollin.RollInSpec("student"), iteration=0,
                              rng=rng, tokenizer=tok)
    unknown_style = Example(prompt_ids=[5], source="rows.jsonl:3", metadata={"environment": "calculator", "expression": "1",
                                                                            "tool_call_style": "xml"})
    with pytest.raises(ValueError, match=r"tool_call_style 'xml' .*known styles: \['hermes', 'llama3'\]"):
        rollin.start_episodes([unknown_style], n_samples_per_prompt=1, spec=rollin.RollInSpec("student"), iteration=0,
                              rng=rng, tokenizer=tok)


def test_a_batched_turn_runs_the_episodes_tools_concurrently():
    together = threading.Barrier(4, timeout=5.0)  # passes only when 4 calls wait at once

    @register_tool(timeout_s=20.0)
    def meet_under_test() -> str:
        """Returns once four calls are running."""
        together.wait()
        return "met"

    @register_environment("meet_under_test")
    class MeetEnvironment(Environment):
        tools = ("meet_under_test",)

        def reset(self, task, rng):
            return "meet"

        def step(self, action):
            return StepResult("", 1.0, True)

    tok = build_tool_chat_tokenizer("qwen")
    turns = [_chars(tok, '<tool_call>{"name": "meet_under_test", "arguments": {}}</tool_call>') + [tok.eos_token_id]] * 4
    turns += [_chars(tok, "ok") + [tok.eos_token_id]] * 4
    example = Example(prompt_ids=[5], source="rows.jsonl:1", metadata={"environment": "meet_under_test", "max_turns": 2})
    rng = random.Random(0)
    try:
        episodes = rollin.start_episodes([example], n_samples_per_prompt=4, spec=rollin.RollInSpec("student"),
                                         iteration=0, rng=rng, tokenizer=tok)
        rollin.run_turns(episodes, engines={Executor.STUDENT: ScriptedEngine(log_prob=-0.25, turns=turns)}, sampling=SamplingParams(),
                         tokenizer=tok, rng=rng)
    finally:
        ENVIRONMENTS.unregister("meet_under_test")
        TOOLS.unregister("meet_under_test")
    for episode in episodes:
        counts = episode.sample.metadata["episode"]
        assert (counts["tool_calls"], counts["tool_errors"], counts["tool_timeouts"]) == (1, 0, 0)
        assert "\nmet\n" in tok.decode(episode.sample.response_ids) and episode.sample.reward == 1.0
