"""The reaper of a local Ray cluster: whatever a run's driver started ends when the driver ends, even
when the driver is SIGKILLed.

    reaper = ClusterReaper.start()     # before `ray.init` starts the local cluster
    ...
    reaper.finish()                    # after `ray.shutdown()`: stop what of Ray's is still running

Why: after a SIGKILLed driver, Ray's own processes notice late (ray::DashboardAgent and
ray::RuntimeEnvAgent lived 35 s to 4 minutes), and under load so did the run's `stacx serve`.

How: `start` puts a fresh token in the driver's environment (`REAPER_TOKEN_ENV`), so every process
started after it (GCS, raylet, agents, workers, `stacx serve`) carries it, wherever it is re-parented
to; and starts this module as a small process in its own session, holding the read end of a pipe whose
write end only the driver holds. When the pipe closes without a word (the driver ended, however) or
the driver is no longer its parent, the reaper sends SIGTERM to every process with the token, SIGKILL
to those left after KILL_AFTER_S, and exits. `finish` (a normal shutdown) writes `ray` first: then
only Ray's processes are swept (the driver stops its own servers), and the reaper exits.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

REAPER_TOKEN_ENV = "STACX_RAY_CLUSTER_TOKEN"
"""Environment variable that marks the processes of one local cluster (its value is the cluster's token)."""
KILL_AFTER_S = 5.0
"""Seconds between SIGTERM and SIGKILL for a swept process."""
DRIVER_POLL_S = 1.0
"""Seconds between two looks at the driver when its pipe says nothing."""
RAY_ONLY = "ray"


def processes_with_token(token: str, *, exclude: tuple[int, ...] = ()) -> list[int]:
    """Pids of this user's processes whose environment carries `REAPER_TOKEN_ENV=token`."""
    marker = f"{REAPER_TOKEN_ENV}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or another user's
            continue
    return found


def is_ray_process(pid: int) -> bool:
    """A process of Ray's own (GCS, raylet, dashboard and its agents, workers), from its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return cmdline.startswith("ray::") or f"{os.sep}ray{os.sep}" in cmdline


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def sweep(token: str, *, ray_only: bool = False, kill_after_s: float = KILL_AFTER_S) -> list[int]:
    """SIGTERM every process carrying `token` (Ray's only, with `ray_only`), SIGKILL those still there
    `kill_after_s` later; returns the pids signalled."""
    def targets() -> list[int]:
        pids = processes_with_token(token, exclude=(os.getpid(),))
        return [pid for pid in pids if is_ray_process(pid)] if ray_only else pids

    signalled = targets()
    for pid in signalled:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + kill_after_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in targets()):
        time.sleep(0.1)
    for pid in targets():  # the token again: a pid reused since carries none
        _signal(pid, signal.SIGKILL)
    return signalled


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def reap(token: str, driver_pid: int, pipe=None) -> None:
    """Wait until the driver ends (its pipe closes, or it is no longer this process's parent) or says
    `ray` (a normal shutdown), then sweep the cluster's processes."""
    pipe = sys.stdin.buffer if pipe is None else pipe
    said = b""
    while True:
        if os.getppid() != driver_pid:
            break
        ready, _, _ = select.select([pipe], [], [], DRIVER_POLL_S)
        if ready:
            chunk = os.read(pipe.fileno(), 64)
            if not chunk:
                break
            said += chunk
            if said.strip() == RAY_ONLY.encode():
                break
    sweep(token, ray_only=said.strip() == RAY_ONLY.encode())


class ClusterReaper:
    """The driver's end of a reaper process (see the module doc)."""

    def __init__(self, process: subprocess.Popen, token: str, previous_token: str | None):
        self.process = process
        self.token = token
        self._previous_token = previous_token

    @classmethod
    def start(cls) -> "ClusterReaper":
        """Mark this driver's future children with a fresh token and start the reaper that watches it."""
        token = uuid.uuid4().hex
        previous = os.environ.get(REAPER_TOKEN_ENV)
        os.environ[REAPER_TOKEN_ENV] = token
        process = subprocess.Popen(  # its own session: a Ctrl-C or `kill -- -PGID` of the run leaves it to sweep
            # This file as a script, isolated (-I): the standard library only, no package import (a light process).
            [sys.executable, "-I", os.path.abspath(__file__), token, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        return cls(process, token, previous)

    def finish(self) -> None:
        """A normal shutdown (after `ray.shutdown()`): the reaper stops what of Ray's still runs and exits;
        this driver's later children no longer carry the token."""
        if self._previous_token is None:
            os.environ.pop(REAPER_TOKEN_ENV, None)
        else:
            os.environ[REAPER_TOKEN_ENV] = self._previous_token
        try:  # not waited for: the driver goes on while the reaper sweeps (up to KILL_AFTER_S)
            self.process.stdin.write(RAY_ONLY.encode())
            self.process.stdin.close()
        except OSError:  # the reaper is gone already
            pass


if __name__ == "__main__":
    reap(sys.argv[1], int(sys.argv[2]))
