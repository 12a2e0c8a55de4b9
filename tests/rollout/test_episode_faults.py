"""Failed episodes (stacx.rollout.episode_retry): infrastructure failures are told apart from the policy's,
retried, then dropped; a group with a dropped episode is replaced by a fresh prompt's; too many losses stop
the step naming the cause. A real sandbox server (in this process) stopped mid-episode on an SWE task."""

from __future__ import annotations

import json
import random
import sys

import pytest
import requests

from stacx.rollout import rollin
from stacx.rollout.agents.agent_command import AgentCommand, AgentCommandTimeout
from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
from stacx.rollout.dagger import Executor
from stacx.rollout.data import Example
from stacx.rollout.episode_retry import (DROPPED_KEY, EpisodeLossError, InfrastructureError, infrastructure_cause,
                                         is_dropped, replace_dropped_groups, retry_failed, retrying_reward)
from stacx.rollout.manager import Sample
from stacx.rollout.rewards import compute_rewards
from stacx.wire.types import GenerateOutput, SamplingParams
from stacx.sandbox import SandboxConfig, SandboxUnavailableError, build_sandbox
from stacx.sandbox.protocol import SandboxServerError

TOKENIZER = build_tool_chat_tokenizer("qwen")
TASK_ID = "seriescalc__sum_up_to"


def test_infrastructure_failures_are_told_apart_from_the_policys():
    assert infrastructure_cause(SandboxUnavailableError("server gone")) == "sandbox"
    assert infrastructure_cause(SandboxServerError("HTTP 502")) == "sandbox"
    assert infrastructure_cause(InfrastructureError("tool_transport", "socket closed")) == "tool_transport"
    try:
        try:
            raise SandboxUnavailableError("gone")
        except SandboxUnavailableError as inner:
            raise RuntimeError("the tool failed") from inner
    except RuntimeError as outer:
        assert infrastructure_cause(outer) == "sandbox"  # a wrapped one is found
    for policy in (ValueError("bad arguments"), AgentCommandTimeout("ran past --agent-timeout"),
                   RuntimeError("agent command exited with 1")):
        assert infrastructure_cause(policy) is None
    with pytest.raises(ValueError, match="cause 'disk' is unknown"):
        InfrastructureError("disk", "full")


def test_a_sandbox_server_that_does_not_answer_is_an_infrastructure_error():
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sandbox = build_sandbox(SandboxConfig(backend="namespace"))
    from stacx.sandbox.remote import RemoteSandbox

    remote = RemoteSandbox.__new__(RemoteSandbox)  # its server died after it was reached
    remote.url, remote._http, remote.default_limits, remote.slots = (f"http://127.0.0.1:{port}", requests.Session(),
                                                                     sandbox.default_limits, None)
    with pytest.raises(SandboxUnavailableError, match="got no answer") as failure:
        remote.request("POST", "/sessions/x/run", json={}, timeout=5)
    assert infrastructure_cause(failure.value) == "sandbox"


def test_an_agent_program_reports_an_infrastructure_crash_with_exit_status_75():
    crash = AgentCommand(argv=(sys.executable, "-c", "import sys; sys.exit(75)"), timeout_s=60)
    with pytest.raises(InfrastructureError) as failure:
        crash("http://127.0.0.1:1/v1", {"prompt": "x"})
    assert infrastructure_cause(failure.value) == "agent_program"
    plain = AgentCommand(argv=(sys.executable, "-c", "import sys; sys.exit(1)"), timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with 1") as failure:
        plain("http://127.0.0.1:1/v1", {"prompt": "x"})
    assert infrastructure_cause(failure.value) is None  # a crash it does not report is the episode's own


def test_a_reward_call_failing_for_an_infrastructure_reason_is_retried_then_its_sample_dropped():
    calls = []

    def judge(response, label, metadata=None):
        calls.append(response)
        if response == "flaky" and calls.count("flaky") < 3:
            raise requests.ConnectionError("judge unreachable")
        if response == "down":
            raise requests.ConnectionError("judge unreachable")
        if response == "bad":
            raise ValueError("not a number")  # the function's own error: not retried
        return 1.0

    judge.timeout_s = 30.0
    wrapped = retrying_reward(judge, retries=2)
    assert wrapped.timeout_s == 30.0 and wrapped.__name__ == "judge"
    results = compute_rewards(wrapped, ["flaky", "down", "bad", "fine"], [None] * 4)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert calls.count("flaky") == 3 and calls.count("down") == 3 and calls.count("bad") == 1
    samples = [Sample(prompt_ids=[1], response_ids=[2], rollout_log_probs=[0.0], loss_mask=[1], executors=[1],
                      reward_error=r.error) for r in results]
    assert [bool(is_dropped(s)) for s in samples] == [False, True, False, False]
    assert retrying_reward(judge, retries=0) is judge


def sample(group: int, dropped: str | None = None) -> Sample:
    s = Sample(prompt_ids=[1], response_ids=[2], rollout_log_probs=[0.0], loss_mask=[1], executors=[1],
               group_index=group, reward=float(group))
    if dropped:
        s.metadata[DROPPED_KEY] = dropped
    return s


def test_a_group_with_a_dropped_episode_is_replaced_by_a_fresh_prompts_group():
    batch = [sample(0), sample(0), sample(1), sample(1, "sandbox: server gone"), sample(2), sample(2)]
    drawn = []

    def draw(k):
        drawn.append(k)
        return [sample(7), sample(7)]

    out, counts = replace_dropped_groups(batch, draw, num_groups=3, max_dropped_fraction=0.5, step=4)
    assert drawn == [1] and len(out) == 6
    assert [s.group_index for s in out] == [0, 0, 1, 1, 2, 2]  # complete groups, renumbered
    assert [s.reward for s in out] == [0.0, 0.0, 2.0, 2.0, 7.0, 7.0]  # the dropped group's survivor left out too
    assert counts == {"rollout/groups_replaced": 1.0, "rollout/episodes_dropped": 1.0}
    with pytest.raises(EpisodeLossError, match=r"step 4: 1 of 6 episodes were dropped .*--max-dropped-fraction 0.1"
                                               r".*1 x sandbox: server gone"):
        replace_dropped_groups(batch, draw, num_groups=3, max_dropped_fraction=0.1, step=4)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedEngine:
    """Replies with the next scripted action; `before_turn[k]` runs before the k-th request (0-based)."""

    def __init__(self, actions, before_turn=None):
        self.actions, self.before_turn, self.requests = list(actions), dict(before_turn or {}), 0

    def generate(self, requests):
        hook = self.before_turn.get(self.requests)
        self.requests += 1
        if hook is not None:
            hook()
        outputs = []
        for _ in requests:
            ids = TOKENIZER(self.actions.pop(0), add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
            outputs.append(GenerateOutput(output_ids=ids, output_log_probs=[-0.1] * len(ids), finish_reason="stop"))
        return outputs


def test_a_sandbox_server_killed_mid_episode_fails_the_episode_which_plays_again_on_the_restarted_server(tmp_path):
    """The SWE environment on a remote sandbox server: the server stops after the first tool call, the next
    call is an infrastructure failure (not an error observation), and the retry on the restarted server
    (same URL, its sessions gone) plays the episode from its prompt to the end."""
    from stacx.sandbox.server import create_app
    from tests.sandbox.conftest import serving

    def server():
        return serving(create_app(build_sandbox(SandboxConfig(backend="namespace", max_concurrent_runs=2)),
                                  api_key="k"))

    first = server()
    url = first.__enter__()
    stopped = []

    def stop_server():
        first.__exit__(None, None, None)
        stopped.append(url)

    sandbox = {"backend": "remote", "remote_url": url, "remote_api_key": "k",
               "limits": {"wall_time_s": 30, "cpu_time_s": 20}}
    row = Example(prompt_ids=[5], source="swe.jsonl:1", label=TASK_ID,
                  metadata={"environment": "swe", "max_turns": 3, "swe_builtin": TASK_ID, "sandbox": sandbox})
    import stacx.tasks.swe.environment  # noqa: F401 - registers 'swe'

    engine = ScriptedEngine([call("bash", command="ls"), call("bash", command="ls"), call("submit")],
                            before_turn={1: stop_server})
    episodes = rollin.start_episodes([row], n_samples_per_prompt=1, spec=rollin.RollInSpec("student"), iteration=0,
                                     rng=random.Random(0), tokenizer=TOKENIZER)
    rollin.run_turns(episodes, engines={Executor.STUDENT: engine}, sampling=SamplingParams(), tokenizer=TOKENIZER,
                     rng=random.Random(0))
    (failed,) = episodes
    assert stopped and failed.failure.startswith("sandbox: SandboxUnavailableError: sandbox server")
    assert len(failed.turns) == 2  # the second call met the dead server

    restarted = None

    def replay(batch):
        nonlocal restarted
        host, port = url.rsplit(":", 1)
        from stacx.sandbox.server import create_app as app_of
        import threading
        import uvicorn

        restarted = uvicorn.Server(uvicorn.Config(
            app_of(build_sandbox(SandboxConfig(backend="namespace", max_concurrent_runs=2)), api_key="k"),
            host="127.0.0.1", port=int(port), log_level="warning"))
        threading.Thread(target=restarted.run, daemon=True).start()
        _wait_for_health(url)
        fresh = rollin.start_episodes([e.example for e in batch], n_samples_per_prompt=1,
                                      spec=rollin.RollInSpec("student"), iteration=0, rng=random.Random(1),
                                      tokenizer=TOKENIZER)
        rollin.run_turns(fresh, engines={Executor.STUDENT: ScriptedEngine([call("submit")])}, sampling=SamplingParams(),
                         tokenizer=TOKENIZER, rng=random.Random(1))
        return fresh

    try:
        played, retried = retry_failed(episodes, failure=lambda e: e.failure, replay=replay, retries=2)
    finally:
        if restarted is not None:
            restarted.should_exit = True
    (again,) = played
    assert retried == 1 and again.failure is None and again.done
    assert again.sample.metadata["episode"]["turn_infos"][-1]["submitted"] is True


def _wait_for_health(url: str) -> None:
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise AssertionError(f"the restarted sandbox server {url} did not answer /health within 20 s")
