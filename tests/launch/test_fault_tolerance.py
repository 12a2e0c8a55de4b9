"""Runs that survive their parts, through `stacx train` on Ray (the shared test cluster), in one ten-step run of
two-turn episodes in remote sandbox sessions on two CPU engines, every fault injected by the episodes' own
environment (tests/launch/fault_injection.py): an engine killed mid-generation (the tokens it streamed are
continued on the other engine), one killed before a weight push, one hung (SIGSTOP: it stops answering, its socket
stays open) before the next push, the sandbox server killed and restarted, a slow reward. Each engine is noticed, restarted and given the current weights, the episode on the dead
sandbox is played again, and the run completes every step with full batches. Unit-level checks of each path:
tests/rollout/test_engine_faults.py, test_episode_faults.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from stacx.tasks import write_tiny_checkpoint
from tests.launch.test_custom_code_on_every_rank import REPO, train_env

pytestmark = pytest.mark.slow  # `stacx train` on Ray

HOOKS = os.path.join(REPO, "tests", "launch", "chaos_engine_hooks")
"""On the run's PYTHONPATH: its sitecustomize gives the engines the `midkill` hold (fault_injection.py)."""
PROMPTS, SAMPLES = 4, 4
LAST_CALL = 2 * PROMPTS * SAMPLES - 1
"""The index of a rollout step's last environment step call (two per episode): its generations are done."""
CHAOS_PLAN = ",".join([
    "midkill@1.1",  # the newest engine, mid-generation: its streamed tokens continue elsewhere, it is restarted
    f"kill@2.{LAST_CALL}",  # the newest engine, before step 2's weight push: the push's pause is refused
    f"stop@3.{LAST_CALL}",  # the oldest engine hangs before step 3's push: it misses its health checks
    "sandbox@4.3",  # the sandbox server killed and restarted: the episode is played again
    "slow@7.0",  # a slow reward
    f"compare@9.{LAST_CALL}",  # both engines (each restarted) asked the same greedy request at the last step
])


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "sorting"), "sorting", seed=0)


def assert_engines_agree(report: str, version: int) -> None:
    """Both engines (each restarted) serve `version` and answer a greedy request alike."""
    with open(report) as handle:
        engines = json.load(handle)
    assert len(engines) == 2 and all("error" not in e for e in engines), engines
    assert {e["version"] for e in engines} == {version}, engines
    first, second = (e["output_token_logprobs"] for e in engines)
    assert [t[1] for t in first] == [t[1] for t in second]
    assert [t[0] for t in first] == pytest.approx([t[0] for t in second], abs=1e-5)


@pytest.mark.timeout(1500)
def test_chaos_run_engine_kill_hang_sandbox_kill_and_slow_reward_in_one_ten_step_run(tiny_checkpoint, tmp_path,
                                                                                      shared_ray_address):
    """Ten steps (CHAOS_PLAN says which fault comes where): three engine restarts, each engine serving the
    current weights at the next rollout, the sandbox episode played again, every step's batch complete."""
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
    out, report = str(tmp_path / "out"), str(tmp_path / "engines.json")
    command = [sys.executable, "-m", "stacx.train", "--hf-checkpoint", tiny_checkpoint, "--prompt-data", str(rows),
               "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
               "--rollout-max-response-len", "4", "--rollout-engine", "cpu", "--rollout-num-engines", "2",
               "--engine-health-interval-s", "1", "--engine-deadline-s", "120", "--episode-retries", "2",
               "--num-steps", "10", "--out", out, "--no-plots", "--no-progress-bar", "--ray-address",
               shared_ray_address]
    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    python_path = os.pathsep.join([HOOKS, REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = train_env({"CHAOS_PLAN": CHAOS_PLAN, "CHAOS_SANDBOX_PID_FILE": str(pid_file), "CHAOS_REPORT": report,
                     "CHAOS_METRICS": os.path.join(out, "metrics.jsonl"), "CHAOS_HOLD_DIR": str(hold_dir),
                     "PYTHONPATH": python_path})
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1400, cwd=REPO)
    finally:
        os.kill(int(pid_file.read_text()), 9)
        server.wait(timeout=30)
    (tmp_path / "train.stderr").write_text(completed.stderr)  # the whole of it, for a failure's post-mortem
    assert completed.returncode == 0, completed.stderr[-6000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == 10
    assert all(s["rollout/num_samples"] == PROMPTS * SAMPLES for s in steps)  # every step's batch complete
    assert [s["rollout/weight_version"] for s in steps] == [float(step) for step in range(10)]
    # Restarts are counted when an engine is found dead: the mid-rollout kill during step 1 (or, at the latest, at
    # the push after it), the kill before step 2's push and the hang before step 3's push at those pushes.
    restarts = [s["rollout/engine_restarts"] for s in steps]
    assert restarts[0] == 0.0 and restarts[2:] == [1.0, 2.0] + [3.0] * 6, restarts
    assert steps[-1]["rollout/requests_reissued"] >= 1.0  # the mid-rollout kill's requests went to the other engine
    # it was killed holding a generation whose first token its client had: that token went on on the other engine
    assert steps[1]["rollout/tokens_salvaged"] >= 1.0 and os.listdir(hold_dir), (steps[1], completed.stderr[-4000:])
    # Each restarted engine took the push and serves from the next rollout on (step 1's is restarted mid-rollout).
    assert all(s["rollout/live_engines"] == 2.0 for s in steps if s["step"] != 1), (steps, completed.stderr[-4000:])
    assert "Connection refused" in completed.stderr  # the killed engines
    assert "missed 2 health checks in a row" in completed.stderr  # the hung one
    assert_engines_agree(report, version=9)
    # The sandbox's episode was played again; no engine fault cost an episode or a group.
    assert sum(s["rollout/episodes_retried"] for s in steps) >= 1.0
    assert "sandbox: SandboxServerError" in completed.stderr or "sandbox: SandboxUnavailableError" in completed.stderr
    assert all(s["rollout/episodes_dropped"] == 0.0 and s["rollout/groups_replaced"] == 0.0
               for s in steps if s["step"] != 4), steps
