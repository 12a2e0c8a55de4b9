"""Faults injected into a `stacx train` run from its episodes' environment, which runs in the driver, the parent
of the run's launched `stacx serve` engines: tests/launch/test_fault_tolerance.py. The run also has an attached
engine (`--rollout-urls`): a `stacx serve` the test started, its process id in CHAOS_ATTACHED_PID_FILE, the
command that starts it (JSON) in CHAOS_ATTACHED_COMMAND.

`SandboxedEcho` (`tests.launch.fault_injection:SandboxedEcho` in a prompt row's metadata) is a two-turn
environment whose steps run a command in a session of a remote sandbox server. CHAOS_PLAN (environment) lists
`action@S.N`, each done once, at the N-th environment step call (0-based; every episode makes two) of rollout
step S (0-based: the rows the run's CHAOS_METRICS file, its metrics.jsonl, holds when the call is made; the
driver writes a step's row before the next rollout starts, so a retried episode shifts no later step's calls):
- `kill@S.N`: SIGKILL the newest launched engine (mid-rollout: the episodes' next turns are generated after it; at the
  step's last call, after its generations and before its weight push: the push's pause is refused);
- `midkill@S.N`: the newest engine is killed mid-generation: it holds its next generation after its first token
  (`hold_engine_when_asked`, in the engine) and is SIGKILLed once the run's client has received that token in a
  streamed piece (`kill_held_engines_on_their_pieces`, in the driver), so the tokens it streamed are salvaged
  (`rollout/tokens_salvaged`); its held call can never finish first: no timing decides it;
- `stop@S.N`: SIGSTOP the oldest launched engine (a hung one: it stops answering, its socket stays open; at the step's
  last call, its pause for the push misses the health checks);
- `sandbox@S.N`: SIGKILL the sandbox server and start another on its port (this episode's session is gone
  with it: its command fails, and the episode is played again on the new server);
- `slow@S.N`: this step takes SLOW_S seconds more (a slow reward: the environment computes it);
- `detach@S.N`: SIGKILL the attached engine (at the step's last call: the push's pause finds it dead, the run
  sets it aside, it cannot restart it) and start it again on its port once the run's pool waits for it
  (`reattach_once_the_run_waits`: the next rollout finds one engine live, fewer than --min-live-engines, and
  blocks within --attached-engine-wait-s); back, it serves the checkpoint's weights, behind the pool's;
- `compare@S.N`: ask every engine, the attached one included, for the same greedy completion and its weight version, and write them (JSON)
  to CHAOS_REPORT: engines that serve equal weights answer equally (an engine that cannot be asked is
  written with its error, so the test names it).
The restarted sandbox server's process id is written to CHAOS_SANDBOX_PID_FILE. A `midkill` engine is told to
hold through a file named by its process id in CHAOS_HOLD_DIR; the engines load `hold_engine_when_asked` from
tests/launch/chaos_engine_hooks/sitecustomize.py (on their PYTHONPATH).

Every fault acts on the process that serves a server's port (`serving_pid`), not on the process its starter holds:
the two differ when the suite's processes are forked from its warm zygote (tests/warm.py), where the process a
starter holds is the client and the server is the client's child; killing that child ends its client with the
same status, as a cold server's death would.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

import requests

from stacx.rollout.agents.environments import Environment, StepResult
from stacx.sandbox import SandboxConfig, build_sandbox
from tests.warm import warm_python

SLOW_S = 3.0
_lock = threading.Lock()


def engine_processes() -> list[int]:
    """Process ids of this process's live launched `stacx serve` children, oldest first (a killed one not yet
    reaped, a zombie, is not an engine; the attached engine, restarted from here, is not one of them)."""
    me, attached = str(os.getpid()), attached_engine_pid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                state, parent = handle.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().split(b"\0")
        except OSError:
            continue
        if parent == me and state != "Z" and b"serve" in command and b"stacx" in command and int(entry) != attached:
            found.append(int(entry))
    return sorted(found)


def serving_pid(url: str) -> int:
    """The process listening on `url`'s port (its socket's inode in /proc/net/tcp, then the process holding it;
    the oldest holder if a child inherited it)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    holders = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{entry}/fd")):
                with open(f"/proc/{entry}/stat") as handle:
                    holders[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    if not holders:
        raise RuntimeError(f"no process listens on {url}")
    return next(pid for pid, parent in holders.items() if parent not in holders)


def _wait_until_port_is_free(url: str, timeout_s: float = 60.0) -> None:
    """Until nothing listens on `url`'s port (a SIGKILLed server may still be exiting)."""
    def free():
        try:
            serving_pid(url)
        except RuntimeError:
            return True
        return False

    _wait_until(free, f"{url}'s port to be free", timeout_s=timeout_s)


def engine_urls() -> dict[int, str]:
    """{process id: URL} of this run's live `stacx serve` engines, from the run's own launcher objects (the
    reward runs in the driver, which holds them). A server process also listens on one socket per gloo
    group of its single-process world, so its listening ports alone do not say which one is HTTP."""
    from stacx.rollout.engines.launchers import CpuServerProcess

    return {server.process.pid: server.url for server in gc.get_objects()
            if isinstance(server, CpuServerProcess) and server.url and server.process.poll() is None}


def ask_engine(pid: int, url: str) -> dict:
    """Engine `pid`'s weight version and its greedy completion of a fixed prompt, with log-probs."""
    answer = requests.post(f"{url}/generate", json={
        "input_ids": [3, 4, 5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
        "return_logprob": True}, timeout=60)
    answer.raise_for_status()
    version = requests.get(f"{url}/get_weight_version", timeout=60).json()["weight_version"]
    logprobs = answer.json()["meta_info"]["output_token_logprobs"]
    return {"pid": pid, "version": int(version), "output_token_logprobs": logprobs}


def attached_engine_pid() -> int | None:
    path = os.environ.get("CHAOS_ATTACHED_PID_FILE")
    if not path:
        return None
    with open(path) as handle:
        return int(handle.read())


def attached_engine_url() -> str:
    command = json.loads(os.environ["CHAOS_ATTACHED_COMMAND"])
    return f"http://127.0.0.1:{command[command.index('--port') + 1]}"


def reattach_once_the_run_waits() -> None:
    """`detach`'s second half, in a thread of the driver: once the run's pool is blocked waiting for the attached
    engine (its supervisor counts the wait: `attached_engine_waits`; the run has --min-live-engines 2, so one
    engine out stops its rollout), the attached engine's command again (on its port, exiting with this driver).
    The run's own health probe then takes it back: the engine coming back can never come first, no timing
    decides it."""
    from stacx.rollout.engine_health import EngineSupervisor

    url = attached_engine_url()
    supervisor = next(s for s in gc.get_objects() if isinstance(s, EngineSupervisor) and url in s.names)

    def restart() -> None:
        import subprocess

        _wait_until(lambda: supervisor.attached_engine_waits > 0, "the run's pool to wait for the attached engine",
                    timeout_s=900.0)
        command = [*json.loads(os.environ["CHAOS_ATTACHED_COMMAND"]), "--parent-pid", str(os.getpid())]
        process = subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        with open(os.environ["CHAOS_ATTACHED_PID_FILE"], "w") as handle:
            handle.write(str(process.pid))

    threading.Thread(target=restart, daemon=True, name="chaos-reattach").start()


def _wait_until(ready, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"waited {timeout_s:g} s for {what}")


def compare_engines() -> None:
    report, urls = [], engine_urls()
    if attached_engine_pid() is not None:
        urls[attached_engine_pid()] = attached_engine_url()
    for pid in [*engine_processes(), *filter(None, [attached_engine_pid()])]:
        try:
            report.append(ask_engine(pid, urls[pid]))
        except Exception as err:  # noqa: BLE001 - written down for the test to name, the run goes on
            report.append({"pid": pid, "error": f"{type(err).__name__}: {err}"})
    with open(os.environ["CHAOS_REPORT"], "w") as handle:
        json.dump(report, handle)


_step_calls: dict[int, int] = {}


def _rollout_step() -> int:
    """The rollout step being played: the rows of the run's metrics.jsonl (flushed as each step ends)."""
    try:
        with open(os.environ["CHAOS_METRICS"]) as handle:
            return sum(1 for line in handle if line.strip())
    except FileNotFoundError:
        return 0


def _next_call() -> tuple[int, int]:
    """(rollout step, this environment step call's index within it)."""
    with _lock:
        step = _rollout_step()
        index = _step_calls.get(step, 0)
        _step_calls[step] = index + 1
        return step, index


HELD_PIECE = "chaos_held"
"""The key an engine adds to a streamed piece of the generation it holds (`hold_engine_when_asked`)."""
_kill_on_held_piece: dict[str, int] = {}
"""{engine URL: its process id} of the engines to SIGKILL at their first held piece."""


def hold_engine_when_asked() -> None:
    """In a `stacx serve` engine: once CHAOS_HOLD_DIR holds a file named by its process id, the next token the
    engine records is its last: the decoding waits (until the process is killed), and the streamed pieces of that
    token's request are marked HELD_PIECE. Only the held call's own pieces are marked: a call that already finished
    may still be sending its last piece and its answer, and killing on that piece would not break its stream."""
    from stacx.serving import cpu_engine, generate_stream

    hold_file = os.path.join(os.environ["CHAOS_HOLD_DIR"], str(os.getpid()))
    held: list = []  # the held output
    record, progress = cpu_engine.CpuEngine._record_token, generate_stream.progress

    def record_then_hold(self, out, *args):
        going_on = record(self, out, *args)
        if os.path.exists(hold_file):
            held.append(out)
            threading.Event().wait()  # the driver kills this process once its client holds the token
        return going_on

    def marked_progress(flags, requests, sent):
        pieces = progress(flags, requests, sent)
        for piece in pieces:
            if any(flags[piece["index"]].output is out for out in held):
                piece[HELD_PIECE] = True
        return pieces

    cpu_engine.CpuEngine._record_token = record_then_hold
    generate_stream.progress = marked_progress


def kill_held_engines_on_their_pieces() -> None:
    """In the driver, before its first generation (this module is imported for the episodes' environment): the
    streamed `/generate` of every client SIGKILLs an engine armed by `midkill` as soon as it receives a piece of
    the engine's held generation, before the client keeps it."""
    from stacx.wire.http_client import HttpTransport

    post_lines = HttpTransport.post_lines

    def watched_lines(self, endpoint, body, **kwargs):
        for line in post_lines(self, endpoint, body, **kwargs):
            if any(piece.get(HELD_PIECE) for piece in line.get("progress", ())):
                with _lock:
                    pid = _kill_on_held_piece.pop(self.url, None)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
            yield line

    HttpTransport.post_lines = watched_lines


def arm_mid_generation_kill() -> None:
    """`midkill`: the newest engine holds its next generation and is killed at the client's first piece of it."""
    url = engine_urls()[engine_processes()[-1]]
    pid = serving_pid(url)
    with _lock:
        _kill_on_held_piece[url] = pid
    with open(os.path.join(os.environ["CHAOS_HOLD_DIR"], str(pid)), "w"):
        pass


def _chaos(step: int, index: int, task: dict) -> None:
    for item in filter(None, os.environ.get("CHAOS_PLAN", "").split(",")):
        action, at = item.split("@")
        if at != f"{step}.{index}":
            continue
        if action == "kill":
            os.kill(serving_pid(engine_urls()[engine_processes()[-1]]), signal.SIGKILL)
        elif action == "midkill":
            arm_mid_generation_kill()
        elif action == "stop":
            os.kill(serving_pid(engine_urls()[engine_processes()[0]]), signal.SIGSTOP)
        elif action == "sandbox":
            restart_sandbox_server(task)
        elif action == "slow":
            time.sleep(SLOW_S)
        elif action == "compare":
            compare_engines()
        elif action == "detach":
            os.kill(serving_pid(attached_engine_url()), signal.SIGKILL)
            reattach_once_the_run_waits()
        else:
            raise ValueError(f"CHAOS_PLAN: unknown action {action!r}")


def restart_sandbox_server(task: dict) -> None:
    """SIGKILL the sandbox server (its pid from the pid file) and start a new one on its port, healthy on return."""
    import subprocess

    pid_file = os.environ["CHAOS_SANDBOX_PID_FILE"]
    os.kill(serving_pid(task["sandbox_url"]), signal.SIGKILL)
    _wait_until_port_is_free(task["sandbox_url"])
    port = task["sandbox_url"].rsplit(":", 1)[1]
    env = dict(os.environ, CHAOS_SANDBOX_KEY=task["sandbox_key"])
    process = subprocess.Popen([warm_python(), "-m", "stacx.sandbox.server", "--port", port,
                                "--api-key-env", "CHAOS_SANDBOX_KEY"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    with open(pid_file, "w") as handle:
        handle.write(str(process.pid))
    _wait_until(lambda: requests.get(f"{task['sandbox_url']}/health", timeout=1).ok,
                "the restarted sandbox server's /health", timeout_s=60.0)


class SandboxedEcho(Environment):
    """Two turns; each step runs `true` in the episode's remote sandbox session (reward 1.0 at the end)."""

    def reset(self, task, rng):
        self.task = task
        sandbox = build_sandbox(SandboxConfig(backend="remote", remote_url=task["sandbox_url"],
                                              remote_api_key=task["sandbox_key"]))
        self.session = sandbox.create(_snapshot())
        return [{"role": "user", "content": task["digits"]}]

    def step(self, action):
        _chaos(*_next_call(), self.task)
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


if os.environ.get("CHAOS_HOLD_DIR") and "serve" not in sys.orig_argv:  # the driver (the engines: sitecustomize)
    kill_held_engines_on_their_pieces()
