"""Runs that survive their parts, through `stacx train` on Ray (the shared test cluster), in one ten-step run of
two-turn episodes in remote sandbox sessions on two CPU engines, one the run launched and one it attached
(`--rollout-urls`: a `stacx serve` this test started), with `--min-live-engines 2` (one engine out stops the
rollout until it is back), every fault injected by the episodes' own environment (tests/launch/fault_injection.py):
the launched engine killed mid-generation (the rollout waits for its restart, then the tokens it streamed are
continued), killed before a weight push, hung (SIGSTOP: it stops answering, its socket stays open) before the next
push; the attached engine killed before a push: the next rollout blocks within `--attached-engine-wait-s` until
its owner has started it again on its port and its health check passes; the sandbox server killed and restarted,
a slow reward. The launched engine is noticed, restarted and given the current weights each time; the attached
one is set aside, waited for, taken back and given the current weights; the episode on the dead sandbox is played
again, and the run completes every step with full batches.
Unit-level checks of each path: tests/rollout/test_engine_faults.py, test_episode_faults.py,
test_attached_engine_wait.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from stacx.tasks import write_tiny_checkpoint
from tests.launch.test_custom_code_on_every_rank import REPO, train_env
from tests.warm import warm_python

pytestmark = pytest.mark.slow  # `stacx train` on Ray

HOOKS = os.path.join(REPO, "tests", "launch", "chaos_engine_hooks")
"""On the run's PYTHONPATH: its sitecustomize gives the engines the `midkill` hold (fault_injection.py)."""
PROMPTS, SAMPLES = 4, 4
LAST_CALL = 2 * PROMPTS * SAMPLES - 1
"""The index of a rollout step's last environment step call (two per episode): its generations are done."""
CHAOS_PLAN = ",".join([
    "midkill@0.1",  # the launched engine, mid-generation: restarted (version 0 still: it serves at once), its
    # streamed tokens continue once it is back (the pool waits for its restart: --min-live-engines 2)
    f"kill@2.{LAST_CALL}",  # the launched engine, before step 2's weight push: the push's pause is refused
    f"stop@3.{LAST_CALL}",  # the launched engine hangs before step 3's push: it misses its health checks
    "sandbox@4.3",  # the sandbox server killed and restarted: the episode is played again
    f"detach@5.{LAST_CALL}",  # the attached engine killed before step 5's push: set aside, not restarted; step
    # 6's rollout waits for it (--attached-engine-wait-s), its owner starts it again once the run waits, it is
    # taken back behind, the weights are pushed to it and the step rolls out again
    "slow@7.0",  # a slow reward
    f"compare@9.{LAST_CALL}",  # both engines (each restarted) asked the same greedy request at the last step
])
API_KEY = "chaos-engine-key"
"""The driver's STACX_API_KEY: the attached engine takes it, and the launched one beside it is given it."""


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "sorting"), "sorting", seed=0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(url: str, process: subprocess.Popen, timeout_s: float = 900.0) -> None:
    """Until the server at `url` answers /health (polled; bounded); its exit first fails the test."""
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the attached engine exited with {process.returncode} before it served"
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the attached engine at {url} did not answer /health within {timeout_s:g} s")


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
    """Ten steps (CHAOS_PLAN says which fault comes where): three restarts of the launched engine, the attached one
    set aside, waited for and taken back, each engine serving the current weights at the next rollout, the sandbox
    episode played again, every step's batch complete."""
    port = free_port()
    url, key = f"http://127.0.0.1:{port}", "chaos-key"
    server = subprocess.Popen([warm_python(), "-m", "stacx.sandbox.server", "--port", str(port), "--api-key-env",
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
    attached_url = f"http://127.0.0.1:{free_port()}"
    command = [warm_python(), "-m", "stacx.train", "--hf-checkpoint", tiny_checkpoint, "--prompt-data", str(rows),
               "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
               "--rollout-max-response-len", "4", "--rollout-engine", "cpu", "--rollout-num-engines", "1",
               "--rollout-urls", attached_url, "--attached-engine-wait-s", "300", "--min-live-engines", "2",
               "--engine-health-interval-s", "1", "--engine-deadline-s", "120", "--episode-retries", "2",
               "--num-steps", "10", "--out", out, "--no-plots", "--no-progress-bar", "--ray-address",
               shared_ray_address]
    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    python_path = os.pathsep.join([HOOKS, REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    # the attached engine: started here (the run cannot restart it), loading while the run starts
    attached_command = [warm_python(), "-m", "stacx", "serve", "--hf-checkpoint", tiny_checkpoint, "--host",
                        "127.0.0.1", "--port", attached_url.rsplit(":", 1)[1], "--seed", "1"]
    attached_pid_file = tmp_path / "attached.pid"
    env = train_env({"CHAOS_PLAN": CHAOS_PLAN, "CHAOS_SANDBOX_PID_FILE": str(pid_file), "CHAOS_REPORT": report,
                     "CHAOS_METRICS": os.path.join(out, "metrics.jsonl"), "CHAOS_HOLD_DIR": str(hold_dir),
                     "CHAOS_ATTACHED_PID_FILE": str(attached_pid_file),
                     "CHAOS_ATTACHED_COMMAND": json.dumps(attached_command), "STACX_API_KEY": API_KEY,
                     "PYTHONPATH": python_path})
    attached = subprocess.Popen(attached_command, env=dict(env, OMP_NUM_THREADS="1"), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # as the run starts its own
    attached_pid_file.write_text(str(attached.pid))
    try:
        wait_for_health(attached_url, attached)  # the run checks its engines once, within 60 s of its own start
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1400, cwd=REPO)
    finally:
        os.kill(int(pid_file.read_text()), 9)
        server.wait(timeout=30)
        for pid in {attached.pid, int(attached_pid_file.read_text())}:  # the first one, and the one started again
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        attached.wait(timeout=30)
    (tmp_path / "train.stderr").write_text(completed.stderr)  # the whole of it, for a failure's post-mortem
    assert completed.returncode == 0, completed.stderr[-6000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == 10
    assert all(s["rollout/num_samples"] == PROMPTS * SAMPLES for s in steps)  # every step's batch complete
    assert [s["rollout/weight_version"] for s in steps] == [float(step) for step in range(10)]
    # Restarts are counted when an engine is found dead: the mid-rollout kill during step 0, the kill before step
    # 2's push and the hang before step 3's push at those pushes. The attached engine is never restarted by the run.
    restarts = [s["rollout/engine_restarts"] for s in steps]
    assert restarts == [1.0] * 3 + [2.0] + [3.0] * 6, restarts
    assert steps[-1]["rollout/requests_reissued"] >= 1.0  # the mid-rollout kill's requests went on after its restart
    # it was killed holding a generation whose first token its client had: that token went on once it was back
    assert steps[0]["rollout/tokens_salvaged"] >= 1.0 and os.listdir(hold_dir), (steps[0], completed.stderr[-4000:])
    # The attached engine, killed after step 5's generations, is set aside at the push (step 6's row counts it).
    # Step 6's rollout finds one engine live, fewer than --min-live-engines 2, and waits (its owner starts it again
    # only once the run waits: the wait cannot be skipped); back behind the pool's weights, it gets version 6 and
    # the step rolls out again on both engines.
    assert [s["rollout/engines_set_aside"] for s in steps] == [0.0] * 6 + [1.0] * 4, steps
    assert [s["rollout/engines_rejoined"] for s in steps] == [0.0] * 6 + [1.0] * 4, steps
    assert [s["rollout/attached_engine_waits"] for s in steps] == [0.0] * 6 + [1.0] * 4, steps
    waited = [s["rollout/attached_engine_wait_s"] for s in steps]
    assert waited[:6] == [0.0] * 6 and 0.0 < waited[6] < 300.0 and waited[6:] == [waited[6]] * 4, waited
    assert "the rollout waits up to 300 s (--attached-engine-wait-s) for the attached engine(s) " \
           f"{attached_url}" in completed.stderr, completed.stderr[-4000:]
    assert "rejoins the pool (its health check passes again)" in completed.stderr
    assert "pushing the weights of version 6 to them and rolling out again" in completed.stderr
    # Each restarted engine took the push and serves from the next rollout on; every rollout ended on both engines.
    live = [s["rollout/live_engines"] for s in steps]
    assert live == [2.0] * 10, (live, completed.stderr[-4000:])
    assert "Connection refused" in completed.stderr  # the killed engines
    assert "missed 2 health checks in a row" in completed.stderr  # the hung one
    assert_engines_agree(report, version=9)  # the launched engine and the attached one
    # The sandbox's episode was played again; no engine fault cost an episode or a group.
    assert sum(s["rollout/episodes_retried"] for s in steps) >= 1.0
    assert "sandbox: SandboxServerError" in completed.stderr or "sandbox: SandboxUnavailableError" in completed.stderr
    assert all(s["rollout/episodes_dropped"] == 0.0 and s["rollout/groups_replaced"] == 0.0
               for s in steps if s["step"] != 4), steps
