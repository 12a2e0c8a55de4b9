"""The `swe` environment played in process by a scripted engine (Qwen-style tool calls): a fix made through
the tools earns 1.0, a submit without a fix 0.0, sandbox failures and timeouts are counted error observations,
and every episode's sandbox session is closed (its working copy deleted) however the episode ends."""

import json
import random

import pytest

from stacx.rollout import rollin
from stacx.rollout.chat_tokenizers import build_tool_chat_tokenizer
from stacx.rollout.dagger import Executor
from stacx.rollout.data import Example
from stacx.rollout.engines.base import GenerateOutput
from stacx.rollout.episode import run_episode
from stacx.rollout.tool_calls import ToolCall
from stacx.rollout.tools import MAX_TOOL_OUTPUT_CHARS
from stacx.rollout.types import SamplingParams
from stacx.tasks.swe import SweEvaluation, get_swe_task
from stacx.tasks.swe.environment import SweEnvironment, clip

TOKENIZER = build_tool_chat_tokenizer("qwen")
TASK_ID = "seriescalc__sum_up_to"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedEngine:
    """Replies with the next scripted action (+ eos) on each request."""

    def __init__(self, actions):
        self.actions = list(actions)

    def generate(self, requests):
        (request,) = requests
        ids = TOKENIZER(self.actions.pop(0), add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        return [GenerateOutput(output_ids=ids, output_log_probs=[-0.1] * len(ids), finish_reason="stop")]


class TrackedSwe(SweEnvironment):
    opened: list = []

    def reset(self, task, rng):
        messages = super().reset(task, rng)
        TrackedSwe.opened.append(self)
        return messages


def play(actions, *, max_turns=6, wall_time_s=30, **task):
    TrackedSwe.opened = []
    sandbox = {"limits": {"wall_time_s": wall_time_s, "cpu_time_s": 20}}
    environment = TrackedSwe()
    sample = run_episode(environment, {"swe_builtin": TASK_ID, "sandbox": sandbox, **task}, tokenizer=TOKENIZER,
                         engines={Executor.STUDENT: ScriptedEngine(actions)}, turn_executor=lambda turn: Executor.STUDENT,
                         sampling=SamplingParams(), max_turns=max_turns, rng=random.Random(0))
    (played,) = TrackedSwe.opened
    assert not played.session.directory.exists()  # closed: the working copy is deleted
    return sample


def test_a_fix_made_through_the_tools_is_rewarded_and_a_bare_submit_is_not():
    task = get_swe_task(TASK_ID)
    fixed = play([call("bash", command="python3 -c 'from seriescalc import sum_up_to; print(sum_up_to(4))'"),
                  call("read_file", path="seriescalc/core.py"),
                  call("write_file", path="fix.diff", content=task.reference_patch),
                  call("bash", command="patch -p1 < fix.diff && rm fix.diff"),
                  call("submit")], max_turns=6)
    episode = fixed.metadata["episode"]
    assert fixed.reward == 1.0 and fixed.finish_reason == "stop" and episode["turns"] == 5
    assert episode["tool_calls"] == 5 and episode["tool_timeouts"] == 0 and episode["tool_errors"] == 0
    assert episode["turn_infos"][-1]["resolved"] is True
    assert "exit code 0\nstdout:\n6\n" in fixed.response_text and "range(1, n)" in fixed.response_text

    # The training path (rollin, as in a run): a row naming the environment, a submit without a fix.
    TrackedSwe.opened = []
    row = Example(prompt_ids=[5], source="swe.jsonl:1", label=TASK_ID, metadata={
        "environment": f"{__name__}:TrackedSwe", "max_turns": 3, "swe_builtin": TASK_ID})
    episodes = rollin.start_episodes([row], n_samples_per_prompt=1, spec=rollin.RollInSpec("student"), iteration=0,
                                     rng=random.Random(0), tokenizer=TOKENIZER)
    rollin.run_turns(episodes, engines={Executor.STUDENT: ScriptedEngine([call("submit")])},
                     sampling=SamplingParams(), tokenizer=TOKENIZER, rng=random.Random(0))
    (bare,), (played,) = [e.sample for e in episodes], TrackedSwe.opened
    assert bare.reward == 0.0 and bare.metadata["episode"]["turns"] == 1 and not played.session.directory.exists()
    info = bare.metadata["episode"]["turn_infos"][-1]
    assert info["resolved"] is False and set(info["tests"].values()) >= {"failed"}


def test_partial_credit_is_the_fraction_of_listed_tests_that_passed():
    environment = SweEnvironment()
    environment.task, environment.submitted = get_swe_task(TASK_ID), True
    tests = {"a": "passed", "b": "failed", "c": "missing"}
    for partial_credit, evaluation, reward in [(True, SweEvaluation(TASK_ID, False, tests), 1 / 3),
                                               (False, SweEvaluation(TASK_ID, False, tests), 0.0),
                                               (True, SweEvaluation(TASK_ID, False, {}, error="no patch"), 0.0),
                                               (True, SweEvaluation(TASK_ID, True, {"a": "passed"}), 1.0)]:
        environment.partial_credit, environment.evaluation = partial_credit, evaluation
        ending = environment.episode_end()
        assert ending.done and ending.reward == pytest.approx(reward)


@pytest.mark.slow
def test_errors_are_observations_and_the_turn_limit_closes_the_session():
    # 8 s of wall time per command: the sleep times out, and a sandboxed read_file on a loaded machine does not
    # (4 s was passed by one on two cores at a load average of 15-39)
    sample = play([call("read_file", path="no/such.py"), call("bash"), call("bash", command="sleep 30"),
                   "I am done.", call("nope")], max_turns=5, wall_time_s=8)
    episode = sample.metadata["episode"]
    assert sample.reward == 0.0 and sample.finish_reason == "length" and episode["turns"] == 5
    assert episode["tool_errors"] == 2 and episode["tool_timeouts"] == 1  # missing argument, unknown tool; sleep
    assert "No such file" in sample.response_text and "timed out" in sample.response_text
    assert "call submit()" in sample.response_text
    # A sandbox that fails (here: its session is gone) answers an error and counts as one; it never raises.
    (played,) = TrackedSwe.opened
    result = played.call_tool(ToolCall(name="bash", arguments={"command": "true"}, call_id="1"))
    assert result.error == "raised" and result.content.startswith("error: the sandbox failed: SandboxClosedError")


def test_bad_settings_name_the_field_and_long_output_is_cut():
    with pytest.raises(ValueError, match="metadata 'sandbox': sandbox.backend 'dockr' is unknown"):
        SweEnvironment().reset({"swe_builtin": TASK_ID, "sandbox": {"backend": "dockr"}}, random.Random(0))
    with pytest.raises(ValueError, match="unknown built-in SWE task"):
        SweEnvironment().reset({"swe_builtin": "nope"}, random.Random(0))
    text = "".join(f"line {i}\n" for i in range(2000))
    cut = clip(text)
    assert len(cut) < MAX_TOOL_OUTPUT_CHARS + 100 and cut.startswith("line 0\n") and cut.endswith("line 1999\n")
