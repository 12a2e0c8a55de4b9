"""Runs that survive their parts, through `stacx train` on Ray (the shared test cluster): two CPU engines,
one killed and later one hung (SIGSTOP: it stops answering, its socket stays open) by the run's own
reward function (tests/launch/fault_injection.py); each is noticed, restarted and given the current
weights, and the run completes. The slow tier's chaos run adds a slow reward to the same faults over
ten steps. Unit-level checks of each path: tests/rollout/test_engine_faults.py, test_episode_faults.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stacx.tasks import write_tiny_checkpoint
from tests.launch.test_custom_code_on_every_rank import REPO, train_env

pytestmark = pytest.mark.slow  # `stacx train` on Ray

FAULT_REWARD = "tests/launch/fault_injection.py:faulty_reward"
PROMPTS, SAMPLES = 4, 4


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "sorting"), "sorting", seed=0)


def train_with_faults(checkpoint: str, out: str, *, plan: str, num_steps: int, ray_address: str,
                      report: str) -> tuple[list[dict], str]:
    """(metrics of each step, the run's stderr) of a GRPO run on two CPU engines with FAULT_PLAN `plan`."""
    command = [sys.executable, "-m", "stacx.train", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:sorting",
               "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
               "--rollout-max-response-len", "6", "--rollout-engine", "cpu", "--rollout-num-engines", "2",
               "--engine-health-interval-s", "1", "--engine-deadline-s", "120", "--reward-fn", FAULT_REWARD,
               "--num-steps", str(num_steps), "--out", out, "--no-plots", "--no-progress-bar",
               "--ray-address", ray_address]
    env = train_env({"FAULT_PLAN": plan, "FAULT_REPORT": report, "CALLS_PER_STEP": str(PROMPTS * SAMPLES)})
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1400, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-6000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == num_steps, steps
    return steps, completed.stderr


def assert_engines_agree(report: str, version: int) -> None:
    """Both engines (one of them restarted) serve `version` and answer a greedy request alike."""
    with open(report) as handle:
        engines = json.load(handle)
    assert "error" not in engines, engines
    assert len(engines) == 2 and {e["version"] for e in engines} == {version}, engines
    first, second = (e["output_token_logprobs"] for e in engines)
    assert [t[1] for t in first] == [t[1] for t in second]
    assert [t[0] for t in first] == pytest.approx([t[0] for t in second], abs=1e-5)


@pytest.mark.timeout(1500)
def test_a_killed_and_a_hung_engine_are_restarted_with_the_current_weights(tiny_checkpoint, tmp_path,
                                                                           shared_ray_address):
    """Step 1: an engine is killed (its pause for the weight push is refused); step 2: the other hangs (its
    pause misses two health checks). Each is restarted on its URL and takes the push; at step 3 both serve
    version 3 and answer a greedy request alike; all 4 steps train."""
    report = str(tmp_path / "engines.json")
    steps, stderr = train_with_faults(tiny_checkpoint, str(tmp_path / "out"), plan="kill@1,stop@2,compare@3",
                                      num_steps=4, ray_address=shared_ray_address, report=report)
    assert [s["rollout/engine_restarts"] for s in steps] == [0.0, 0.0, 1.0, 2.0]
    assert [s["rollout/weight_version"] for s in steps] == [0.0, 1.0, 2.0, 3.0]
    assert all(s["rollout/live_engines"] == 2.0 for s in steps)
    assert "missed 2 health checks in a row" in stderr and "Connection refused" in stderr
    assert_engines_agree(report, version=3)
    assert all(s["rollout/episodes_dropped"] == 0.0 and s["rollout/groups_replaced"] == 0.0 for s in steps)


@pytest.mark.timeout(1500)
def test_chaos_run_engine_kill_sandbox_kill_and_slow_reward_in_one_ten_step_run(tiny_checkpoint, tmp_path,
                                                                                 shared_ray_address):
    """Ten steps of two-turn episodes in remote sandbox sessions, on two CPU engines: an engine killed between
    the turns of step 1 (its second-turn requests re-issued, the engine restarted), the sandbox server killed and
    restarted during step 4 (that episode played again on the new server), a slow reward step in step 7. The
    run completes every step, each fault counted."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url, key = f"http://127.0.0.1:{port}", "chaos-key"
    server = subprocess.Popen([sys.executable, "-m", "stacx.sandbox.server", "--port", str(port), "--api-key-env",
                               "CHAOS_SANDBOX_KEY"], env=train_env({"CHAOS_SANDBOX_KEY": key}), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = tmp_path / "sandbox.pid"
    pid_file.write_text(str(server.pid))
    rows = tmp_path / "rows.jsonl"
    environment = "tests.launch.fault_injection:SandboxedEcho"
    with open(rows, "w") as handle:
        for index in range(64):
            digits = f"{index % 10}{(index * 7) % 10}{(index * 3) % 10}="
            handle.write(json.dumps({"prompt": digits, "label": "", "metadata": {
                "environment": environment, "max_turns": 2, "sandbox_url": url, "sandbox_key": key,
                "digits": digits}}) + "\n")
    per_step = 2 * PROMPTS * SAMPLES  # environment steps: two per episode
    plan = f"kill@{per_step + 1},sandbox@{4 * per_step + 3},slow@{7 * per_step}"
    out = str(tmp_path / "out")
    command = [sys.executable, "-m", "stacx.train", "--hf-checkpoint", tiny_checkpoint, "--prompt-data", str(rows),
               "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
               "--rollout-max-response-len", "4", "--rollout-engine", "cpu", "--rollout-num-engines", "2",
               "--engine-health-interval-s", "1", "--engine-deadline-s", "120", "--episode-retries", "2",
               "--num-steps", "10", "--out", out, "--no-plots", "--no-progress-bar", "--ray-address",
               shared_ray_address]
    try:
        completed = subprocess.run(command, env=train_env({"CHAOS_PLAN": plan, "CHAOS_SANDBOX_PID_FILE": str(pid_file)}),
                                   capture_output=True, text=True, timeout=1400, cwd=REPO)
    finally:
        os.kill(int(pid_file.read_text()), 9)
        server.wait(timeout=30)
    assert completed.returncode == 0, completed.stderr[-6000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == 10
    assert steps[-1]["rollout/engine_restarts"] == 1.0 and steps[-1]["rollout/requests_reissued"] >= 1.0
    assert sum(s["rollout/episodes_retried"] for s in steps) >= 1.0
    assert all(s["rollout/num_samples"] == PROMPTS * SAMPLES for s in steps)  # every step's batch complete
    assert "sandbox: SandboxServerError" in completed.stderr or "sandbox: SandboxUnavailableError" in completed.stderr
