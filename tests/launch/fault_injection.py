"""Faults injected into a `stacx train` run from its reward function (`--reward-fn
tests/launch/fault_injection.py:faulty_reward`), which runs in the driver, the parent of the run's
`stacx serve` engines: tests/launch/test_fault_tolerance.py.

FAULT_PLAN (environment): comma-separated `action@step`, done once, at the first reward call of that
step (0-based, CALLS_PER_STEP calls a step), so after the step's rollout and before its weight push:
- `kill@S`: SIGKILL the newest engine (a dead engine);
- `stop@S`: SIGSTOP the oldest engine (a hung one: it stops answering, its socket stays open);
- `compare@S`: ask every engine for the same greedy completion and its weight version, and write them
  (JSON) to FAULT_REPORT: engines that serve equal weights answer equally;
- `slow@S`: sleep SLOW_S seconds in this call (a slow reward).
The reward itself is the sorting task's.

`SandboxedEcho` (`tests.launch.fault_injection:SandboxedEcho` in a prompt row's metadata) is a two-turn
environment whose steps run a command in a session of a remote sandbox server; CHAOS_PLAN (environment)
lists `action@N`, done at the N-th step call of the run (0-based; every episode makes two):
- `kill@N`: SIGKILL the newest engine, mid-rollout (the episodes' second turns are generated next);
- `sandbox@N`: SIGKILL the sandbox server and start another on its port (this episode's session is gone
  with it: its command fails, and the episode is played again on the new server);
- `slow@N`: this step takes SLOW_S seconds more (a slow reward: the environment computes it).
The restarted sandbox server's process id is written to CHAOS_SANDBOX_PID_FILE.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time

import requests

from stacx.rollout.agents.environments import Environment, StepResult
from stacx.sandbox import SandboxConfig, build_sandbox
from stacx.tasks import get_task

SLOW_S = 3.0
_lock = threading.Lock()
_calls = [0]
_done: set = set()


def _plan() -> dict[int, list[str]]:
    plan: dict[int, list[str]] = {}
    for item in filter(None, os.environ.get("FAULT_PLAN", "").split(",")):
        action, step = item.split("@")
        plan.setdefault(int(step), []).append(action)
    return plan


def engine_processes() -> list[int]:
    """Process ids of this process's `stacx serve` children, oldest first."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = handle.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().split(b"\0")
        except OSError:
            continue
        if parent == me and b"serve" in command and b"stacx" in command:
            found.append(int(entry))
    return sorted(found)


def engine_urls() -> dict[int, str]:
    """{process id: URL} of this run's live `stacx serve` engines, from the run's own launcher objects (the
    reward runs in the driver, which holds them). A server process also listens on one socket per gloo
    group of its single-process world, so its listening ports alone do not say which one is HTTP."""
    from stacx.rollout.engines.launchers import CpuServerProcess

    return {server.process.pid: server.url for server in gc.get_objects()
            if isinstance(server, CpuServerProcess) and server.url and server.process.poll() is None}


def compare_engines() -> None:
    """Writes FAULT_REPORT; a failure here is written there too (a reward error would be retried, hiding it)."""
    try:
        report = engine_answers()
    except Exception as err:  # noqa: BLE001 - reported to the test through the file
        report = {"error": f"{type(err).__name__}: {err}"}
    with open(os.environ["FAULT_REPORT"], "w") as handle:
        json.dump(report, handle)


def engine_answers() -> list[dict]:
    report = []
    urls = engine_urls()
    for pid in engine_processes():
        url = urls[pid]
        answer = requests.post(f"{url}/generate", json={
            "input_ids": [3, 4, 5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            "return_logprob": True}, timeout=60).json()
        version = requests.get(f"{url}/get_weight_version", timeout=60).json()["weight_version"]
        report.append({"pid": pid, "version": int(version),
                       "output_token_logprobs": answer["meta_info"]["output_token_logprobs"]})
    return report


def inject(step: int) -> None:
    for action in _plan().get(step, []):
        engines = engine_processes()
        if action == "kill":
            os.kill(engines[-1], signal.SIGKILL)
        elif action == "stop":
            os.kill(engines[0], signal.SIGSTOP)
        elif action == "compare":
            compare_engines()
        elif action == "slow":
            time.sleep(SLOW_S)
        else:
            raise ValueError(f"FAULT_PLAN: unknown action {action!r}")


def faulty_reward(response, label, metadata=None):
    calls_per_step = int(os.environ.get("CALLS_PER_STEP", "16"))
    with _lock:
        step, _calls[0] = _calls[0] // calls_per_step, _calls[0] + 1
        first = step not in _done
        _done.add(step)
        if first:
            inject(step)
    return get_task("sorting").reward(response, label, metadata)


_env_steps = [0]


def _chaos(index: int, task: dict) -> None:
    for item in filter(None, os.environ.get("CHAOS_PLAN", "").split(",")):
        action, at = item.split("@")
        if int(at) != index:
            continue
        if action == "kill":
            os.kill(engine_processes()[-1], signal.SIGKILL)
        elif action == "sandbox":
            restart_sandbox_server(task)
        elif action == "slow":
            time.sleep(SLOW_S)
        else:
            raise ValueError(f"CHAOS_PLAN: unknown action {action!r}")


def restart_sandbox_server(task: dict) -> None:
    """SIGKILL the sandbox server (its pid from the pid file) and start a new one on its port, healthy on return."""
    import subprocess
    import sys

    pid_file = os.environ["CHAOS_SANDBOX_PID_FILE"]
    with open(pid_file) as handle:
        os.kill(int(handle.read()), signal.SIGKILL)
    port = task["sandbox_url"].rsplit(":", 1)[1]
    env = dict(os.environ, CHAOS_SANDBOX_KEY=task["sandbox_key"])
    process = subprocess.Popen([sys.executable, "-m", "stacx.sandbox.server", "--port", port,
                                "--api-key-env", "CHAOS_SANDBOX_KEY"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    with open(pid_file, "w") as handle:
        handle.write(str(process.pid))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{task['sandbox_url']}/health", timeout=1).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError("the restarted sandbox server did not answer /health within 60 s")


class SandboxedEcho(Environment):
    """Two turns; each step runs `true` in the episode's remote sandbox session (reward 1.0 at the end)."""

    def reset(self, task, rng):
        self.task = task
        sandbox = build_sandbox(SandboxConfig(backend="remote", remote_url=task["sandbox_url"],
                                              remote_api_key=task["sandbox_key"]))
        self.session = sandbox.create(_snapshot())
        return [{"role": "user", "content": task["digits"]}]

    def step(self, action):
        with _lock:
            index, _env_steps[0] = _env_steps[0], _env_steps[0] + 1
        _chaos(index, self.task)
        result = self.session.run(["true"])
        self.turns = getattr(self, "turns", 0) + 1
        if self.turns == 1:
            return StepResult([{"role": "user", "content": "0="}], 0.0, False)
        return StepResult("", float(result.ok), True)

    def close(self):
        session = getattr(self, "session", None)
        if session is not None:
            session.close()


_folder: list = []


def _snapshot() -> str:
    """A tiny folder every session starts from."""
    import tempfile

    with _lock:
        if not _folder:
            folder = tempfile.mkdtemp(prefix="chaos-snapshot-")
            with open(os.path.join(folder, "README"), "w") as handle:
                handle.write("chaos\n")
            _folder.append(folder)
        return _folder[0]
