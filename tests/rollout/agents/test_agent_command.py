"""`--agent-command`: what the program is given (a scrubbed environment, shell-quoted placeholders), where
its reward comes from (a private file, never its stdout), how long it may run, how its odd output is read,
and how a step waiting for it is named; the flags and their preflight. No server, no model."""

import argparse
import json
import os
import stat
import sys
import threading
import time

import pytest

from stacx.rollout.agents.agent_command import (
    AgentCommand,
    AgentCommandTimeout,
    agent_environment,
    read_reward_file,
    substitute_placeholders,
)
from stacx.rollout.agents.agent_rollout import AgentRollout, agent_from_settings
from stacx.trainer.heartbeat import Heartbeat
from stacx.wire.trajectories import RecordedTurn

TURN = RecordedTurn(prompt_ids=(1, 2), output_ids=(3,), output_log_probs=(-0.5,), weight_version=1)

WRITE_REWARD = "import os; open(os.environ['STACX_REWARD_FILE'], 'w').write({!r})"


def python(script: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", script, *args)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_the_program_gets_a_scrubbed_environment_and_only_the_variables_named_with_agent_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_SECRET", "s3cret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-trainers-own")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-the-trainers-own")
    monkeypatch.setenv("HF_HOME", "/models")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    dump = tmp_path / "env.json"
    script = ("import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w')); "
              + WRITE_REWARD.format("1.0"))
    command = AgentCommand(argv=python(script, str(dump)), passed_env=("HF_HOME",))
    assert command("http://h/sessions/s/v1", {"x": 2}) == 1.0
    seen = json.loads(dump.read_text())
    assert "TRAINER_SECRET" not in seen and seen["OPENAI_API_KEY"] != "sk-the-trainers-own"
    assert seen["ANTHROPIC_API_KEY"] != "sk-ant-the-trainers-own" and seen["ANTHROPIC_BASE_URL"] == "http://h/sessions/s"
    assert seen["HF_HOME"] == "/models" and seen["LC_ALL"] == "C.UTF-8" and seen["PATH"] == os.environ["PATH"]
    assert seen["OPENAI_BASE_URL"] == "http://h/sessions/s/v1" and json.loads(seen["STACX_TASK"]) == {"x": 2}
    allowed = {"PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "HF_HOME", "OPENAI_BASE_URL", "OPENAI_API_KEY",
               "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "STACX_TASK", "STACX_REWARD_FILE"}
    assert set(seen) <= allowed, set(seen) - allowed
    # The reward file lies in a folder only the trainer's user can enter, removed after the episode.
    folder = os.path.dirname(seen["STACX_REWARD_FILE"])
    assert not os.path.exists(folder)
    env = agent_environment("u", "{}", "/r", api_key="episode-key", environ={"A": "1", "PATH": "/bin", "LC_X": "y"})
    assert env == {"PATH": "/bin", "LC_X": "y", "OPENAI_BASE_URL": "u", "OPENAI_API_KEY": "episode-key",
                   "ANTHROPIC_BASE_URL": "u", "ANTHROPIC_API_KEY": "episode-key", "STACX_TASK": "{}",
                   "STACX_REWARD_FILE": "/r"}
    with pytest.raises(ValueError, match="--agent-env 'A=1' is not a variable name"):
        AgentCommand(argv=("x",), passed_env=("A=1",))


def test_the_reward_folder_is_private_to_the_trainer(tmp_path):
    probe = tmp_path / "mode"
    script = ("import os, sys; open(sys.argv[1], 'w').write(oct(os.stat(os.path.dirname("
              "os.environ['STACX_REWARD_FILE'])).st_mode))")
    assert AgentCommand(argv=python(script, str(probe)))("u", {}) is None
    assert stat.S_IMODE(int(probe.read_text(), 8)) == 0o700


def test_a_reward_printed_on_stdout_earns_nothing_only_the_reward_file_counts(monkeypatch):
    # The policy's own answer, echoed by its agent as the program's last line of output.
    echoing = AgentCommand(argv=python("print('I fixed it.'); print('{\"reward\": 1.0}')"))
    assert echoing("u", {}) is None
    rollout = AgentRollout(echoing, server_url="http://127.0.0.1:1", next_tasks=lambda step: [{"label": "t"}],
                           reward_fn=lambda task, samples: 0.0)
    monkeypatch.setattr(AgentRollout, "open_session", lambda self, server_url=None: ("s", "secret"))
    monkeypatch.setattr(rollout, "take_turns", lambda session_id, secret, server_url=None: [TURN])
    samples, _ = rollout.collect(0)
    assert [(s.reward, s.reward_error) for s in samples] == [(0.0, None)]
    # What the program writes to STACX_REWARD_FILE is the reward, whatever it prints.
    writing = AgentCommand(argv=python("print('{\"reward\": 1.0}'); " + WRITE_REWARD.format('{"reward": 0.25}')))
    assert writing("u", {}) == 0.25
    garbage = AgentCommand(argv=python(WRITE_REWARD.format("great")))
    with pytest.raises(ValueError, match="wrote 'great' to STACX_REWARD_FILE; write a number"):
        garbage("u", {})


def test_reward_file_contents(tmp_path):
    path = tmp_path / "reward"
    assert read_reward_file(str(path)) is None
    for text, value in (("", None), ("1", 1.0), (" 0.5\n", 0.5), ('{"reward": 2}', 2.0)):
        path.write_text(text)
        assert read_reward_file(str(path)) == value
    for text in ("true", "NaN", '{"reward": "1"}', "[1]"):
        path.write_text(text)
        with pytest.raises(ValueError, match="STACX_REWARD_FILE"):
            read_reward_file(str(path))


def test_a_hung_program_is_killed_with_its_children_at_the_agent_timeout(tmp_path):
    child = tmp_path / "child"
    hung = AgentCommand(argv=("sh", "-c", f"sleep 600 & echo $! > {child}; echo working >&2; wait"), timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(AgentCommandTimeout, match=r"ran past --agent-timeout 1 s and was killed; last output: working"):
        hung("u", {})
    assert time.monotonic() - started < 30
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the program's child outlived its episode"
    assert agent_from_settings(None, "prog --x", agent_timeout=5, agent_env=("HF_HOME",)) == AgentCommand(
        argv=("prog", "--x"), timeout_s=5.0, passed_env=("HF_HOME",))


def test_output_that_is_not_utf8_is_read_with_replacement():
    binary = "import os, sys; sys.stdout.buffer.write(b'\\xff\\xfe ok\\n'); sys.stderr.buffer.write(b'bad \\xff byte')"
    assert AgentCommand(argv=python(binary + "; " + WRITE_REWARD.format("1")))("u", {}) == 1.0
    with pytest.raises(RuntimeError, match="exited with 3: bad \ufffd byte"):
        AgentCommand(argv=python(binary + "; sys.exit(3)"))("u", {})


def test_placeholders_are_shell_quoted_inside_a_shell_script_and_literal_elsewhere(tmp_path):
    task = {"prompt": "$(touch pwned) `touch pwned2` ' \" ; touch pwned3"}
    out = tmp_path / "out"
    script = AgentCommand(argv=("sh", "-c", "printf %s {task_json} > out"), cwd=str(tmp_path))
    assert script("u", task) is None
    assert json.loads(out.read_text()) == task
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing of the row ran
    argument = tmp_path / "arg"
    literal = AgentCommand(argv=python("import sys; open(sys.argv[1], 'w').write(sys.argv[2])", str(argument),
                                       "{task_json}"))
    assert literal("u", task) is None and json.loads(argument.read_text()) == task
    values = {"base_url": "http://h/v1", "task_json": "{}"}
    assert substitute_placeholders(("bash", "-ec", "run {base_url} {task_json}", "{task_json}"), values) == [
        "bash", "-ec", "run http://h/v1 '{}'", "{}"]
    assert substitute_placeholders(("prog", "-c", "{task_json}"), values) == ["prog", "-c", "{}"]


def test_the_heartbeat_names_the_episodes_a_step_waits_for(monkeypatch):
    release = threading.Event()
    started = threading.Event()

    def slow_agent(base_url, task):
        started.set()
        assert release.wait(30)
        return 1.0

    rollout = AgentRollout(slow_agent, server_url="http://127.0.0.1:1", n_samples_per_task=2,
                           next_tasks=lambda step: [{"source": "rows.jsonl:4"}])
    monkeypatch.setattr(AgentRollout, "open_session", lambda self, server_url=None: ("s", "secret"))
    monkeypatch.setattr(rollout, "take_turns", lambda session_id, secret, server_url=None: [TURN])
    assert rollout.waiting_for() == ""
    collected = []
    worker = threading.Thread(target=lambda: collected.append(rollout.collect(0)))
    worker.start()
    try:
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while "2 agent episodes" not in rollout.waiting_for() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rollout.waiting_for().startswith("waiting for 2 agent episodes: rows.jsonl:4 (2 episodes, ")
        beat = Heartbeat("step 1/2", "rollout", detail=rollout.waiting_for, enabled=False)
        assert "rollout, " in beat.line(time.monotonic()) and "; waiting for 2 agent episodes: rows.jsonl:4" in \
            beat.line(time.monotonic())
    finally:
        release.set()
        worker.join(30)
    assert len(collected[0][0]) == 2 and rollout.waiting_for() == ""
    quiet = Heartbeat("p", "x", detail=lambda: "")
    assert quiet.line(quiet._started) == "stacx: p: x, 0 s"


def test_agent_flags_parse_and_the_preflight_checks_them(monkeypatch):
    from stacx.launch.run_flags import add_run_config_arguments
    from stacx.trainer.config.checks import check_agent_supported
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.preflight import PreflightError
    from stacx.trainer.recipes import get_recipe

    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    given = parser.parse_args(["--agent-env", "HF_HOME", "--agent-env", "HF_TOKEN", "--agent-timeout", "30"])
    assert (given.agent_env, given.agent_timeout) == (["HF_HOME", "HF_TOKEN"], 30.0)
    grpo = get_recipe("grpo")

    def run(**rollout):
        return RunConfig.from_dict({"rollout_engine": "cpu", **rollout})

    monkeypatch.setenv("HF_HOME", "/models")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    command = {"agent_command": f"{sys.executable} agent.py", "agent_timeout": 30}
    check_agent_supported(run(agent_env=["HF_HOME"], **command), grpo)
    with pytest.raises(PreflightError, match="--agent-env HF_TOKEN: no such variable"):
        check_agent_supported(run(agent_env=["HF_HOME", "HF_TOKEN"], **command), grpo)
    with pytest.raises(PreflightError, match="--agent-env applies to an --agent-command program"):
        check_agent_supported(run(agent="a.py:run", agent_env=["HF_HOME"]), grpo)
    with pytest.raises(ValueError, match="agent_timeout"):
        run(agent_timeout=0)


def test_the_runs_heartbeat_asks_the_agent_rollout_what_it_waits_for():
    from types import SimpleNamespace

    from stacx.trainer.loop import StacxTrainer

    rollout = AgentRollout(lambda base_url, task: 1.0, server_url="http://127.0.0.1:1", next_tasks=lambda step: [])
    trainer = StacxTrainer.__new__(StacxTrainer)  # only what `beat` reads
    trainer.channel, trainer.step_rollout = SimpleNamespace(is_driver=False), rollout
    assert trainer.beat("step 1/2", "rollout").detail == rollout.waiting_for
    trainer.step_rollout = None  # a dataset recipe, or a rank that is not the driver
    assert trainer.beat("step 1/2", "batch").detail is None
