"""SandboxEnvironment: mini-swe-agent, unmodified, runs the policy's commands in a sandbox session, not on
the host. Its DefaultAgent is driven by mini-swe-agent's own scripted model (no server, no litellm)."""

import os

import pytest

from stacx.sandbox.agent_environment import SandboxEnvironment

try:
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output
except ImportError as missing:  # a failure with the fix, never a skip
    raise ImportError("these tests run mini-swe-agent, in the test extra: pip install -e '.[test]'") from missing

PROBE = 'id -u; cat /proc/self/uid_map; tr "\\0" " " < /proc/self/environ; echo; echo "[$SECRET]"; cat {host_file}; touch made.txt'


@pytest.mark.parametrize("backend", ["namespace", "bubblewrap"])
def test_mini_swe_agents_commands_run_in_the_sandbox_without_the_trainers_secrets(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET", "s3cret-of-the-trainer")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "code.py").write_text("x = 1\n")
    host_file = tmp_path / "host_secret.txt"
    host_file.write_text("host-only")
    env = SandboxEnvironment(source=str(repo), sandbox={"backend": backend}, timeout=30)
    model = DeterministicModel(outputs=[make_output("probe", [{"command": PROBE.format(host_file=host_file)}]),
                                        make_output("done", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}])],
                               observation_template="{{output.returncode}}|{{output.output}}")
    agent = DefaultAgent(model, env, system_template="sys", instance_template="{{task}}", step_limit=4, cost_limit=0)
    try:
        assert agent.run("probe the machine")["exit_status"] == "Submitted"
        observation = agent.messages[3]["content"]
        lines = observation.split("|", 1)[1].splitlines()
        # Not the host's root: a user other than root, or root of a user namespace mapped to another user (on
        # the host itself, `id -u` is 0 and uid_map is the identity `0 0 4294967295`).
        uid, (inside, outside, _) = int(lines[0]), lines[1].split()
        assert uid != 0 or (inside == "0" and outside != "0"), f"the agent's command ran as the host's root: {observation}"
        assert "SECRET" not in lines[2] and "PATH=/usr/local/bin:/usr/bin:/bin" in lines[2]
        assert lines[3] == "[]" and "s3cret" not in observation and "host-only" not in observation
        assert "No such file" in observation
        assert env.execute({"command": "ls"})["output"].split() == ["code.py", "made.txt"]
    finally:
        env.close()
    assert sorted(os.listdir(repo)) == ["code.py"]  # the host's folder was only copied
    assert "s3cret" not in str(env.get_template_vars()) and env.get_template_vars()["system"] == "Linux"


def test_timeouts_failures_and_the_command_line_route(tmp_path):
    with SandboxEnvironment(timeout=30, cwd="sub") as env:
        assert env.execute("mkdir -p sub; echo out; echo err >&2", cwd="/workspace") == {
            "output": "out\nerr\n", "returncode": 0, "exception_info": ""}
        assert env.execute({"command": "pwd; exit 3"})["output"] == "/workspace/sub\n"
        slow = env.execute({"command": "sleep 30"}, timeout=1)
        assert slow["returncode"] == -1 and "timed out after 1 s" in slow["exception_info"]
    closed = env.execute({"command": "true"})
    assert closed["returncode"] == -1 and "the sandbox failed: SandboxClosedError" in closed["exception_info"]
    # mini-swe-agent's own loader (what `mini --environment-class ...` calls) builds it from its config section.
    made = get_environment({"environment_class": "stacx.sandbox.agent_environment.SandboxEnvironment",
                            "source": str(tmp_path), "timeout": 5})
    try:
        assert isinstance(made, SandboxEnvironment) and made.execute({"command": "pwd"})["output"] == "/workspace\n"
    finally:
        made.close()
    with pytest.raises(ValueError, match="unknown setting"):
        SandboxEnvironment(image="x")
