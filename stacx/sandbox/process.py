"""Running one sandbox launcher process on the host: wall-time limit, output cap, tree kill, slots.

The launcher (`unshare ...`, `bwrap ...`) is started in its own process group and becomes the
parent of the sandbox's PID namespace. To kill a sandbox, its launcher group and every descendant
(the namespace's init among them) get SIGKILL, and the call waits until they are gone: the kernel
ends a PID namespace's init only after every process of the namespace has ended. Output is read
from both pipes with one selector loop, so neither can fill up and block the command.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.protocol import RunResult

_READ_CHUNK = 1 << 16


class RunSlots:
    """At most `max_concurrent_runs` sandboxed commands at once (the others wait for a slot)."""

    def __init__(self, max_concurrent_runs: int):
        if isinstance(max_concurrent_runs, bool) or not isinstance(max_concurrent_runs, int) or max_concurrent_runs < 1:
            raise ValueError(f"sandbox max_concurrent_runs must be an integer >= 1, got {max_concurrent_runs!r}")
        self.max_concurrent_runs = max_concurrent_runs
        self._semaphore = threading.BoundedSemaphore(max_concurrent_runs)
        self._lock = threading.Lock()
        self.running = 0
        self.peak_running = 0
        """The most commands that ran at once since this object was made (a check for tests and metrics)."""

    @contextmanager
    def slot(self):
        with self._semaphore:
            with self._lock:
                self.running += 1
                self.peak_running = max(self.peak_running, self.running)
            try:
                yield
            finally:
                with self._lock:
                    self.running -= 1


def _descendants(pid: int) -> list[int]:
    """Host PIDs of every descendant of `pid`, parents before children (from /proc/PID/task/TID/children)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def _is_gone(pid: int) -> bool:
    """True when `pid` has exited (no such process, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


KILL_WAIT_S = 5.0
"""How long killing a tree waits for the sandbox's processes to be gone."""


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the launcher, its group and every descendant, and wait until they are gone.

    Killing the launcher alone would be enough in the end (the namespace's init gets SIGKILL as its
    parent-death signal, and the kernel then kills the whole namespace), but that happens after the
    launcher is reaped; killing the init from here makes the tree's end part of this call: the
    namespace's init exits only once every process of its namespace has.
    """
    tree = _descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + KILL_WAIT_S
    while not all(_is_gone(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.005)


def _feed_stdin(process: subprocess.Popen, data: bytes) -> None:
    try:
        process.stdin.write(data)
    except (BrokenPipeError, OSError):
        pass  # the command exited without reading all of it
    finally:
        try:
            process.stdin.close()
        except OSError:
            pass


@dataclass
class Launch:
    """How to start one sandboxed command: the launcher's argv, and how to learn its namespace's init."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """The launcher's whole environment: never the host's, since a launcher's environment can be read from
    inside the sandbox (bwrap's own init is the sandbox's PID 1, and keeps it as /proc/1/environ)."""
    executable: Optional[str] = None
    """The program to execute when argv[0] is only the name the sandbox sees (/proc/1/cmdline)."""
    user: Optional[int] = None
    """Host uid (and gid, without supplementary groups) the launcher runs as; None: this process's."""
    pass_fds: tuple[int, ...] = ()
    """File descriptors the launcher inherits (closed here once it started)."""
    read_init_pid: Optional[Callable[[], Optional[int]]] = None
    """Called once the launcher started: the host PID of the sandbox's PID-namespace init, for a launcher that
    may exit before its namespace is gone (bwrap); None for one that waits for it (unshare --fork)."""


def as_user(uid: Optional[int]) -> dict:
    """Popen arguments that run the child as `uid` (gid the same, no supplementary groups): set in the child
    before it executes anything (setregid, setgroups, setreuid), so real, effective and saved ids all change
    and a root parent's capabilities are gone."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _open_init(launch: Launch) -> Optional[int]:
    """A pidfd of the namespace's init (race-free signalling, and readable once it and its namespace ended)."""
    pid = launch.read_init_pid() if launch.read_init_pid is not None else None
    if pid is None:
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None  # already ended, and its namespace with it


def _end_init(pidfd: int) -> None:
    """SIGKILL the namespace's init and wait until it (so every process of its namespace) has ended."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.poll(KILL_WAIT_S * 1000)
    os.close(pidfd)


def run_launcher(launch: Launch, limits: SandboxLimits, *, stdin: Optional[bytes] = None,
                 on_start=None, on_exit=None, watch: Optional[Callable[[], Optional[str]]] = None,
                 watch_interval_s: float = 0.25) -> RunResult:
    """Run the launcher under the host-side limits (wall time, output cap) and collect its result; when it
    returns, nothing of the sandbox's process tree is left.

    on_start(process) / on_exit(process) let a session track its live launchers so `close()` can kill them.
    watch(), called every `watch_interval_s` while the command runs and once after, returns why the command
    must end (a measured bound passed) or None: the tree is killed, the run is `killed`, the reason ends stderr.
    """
    started = time.monotonic()
    try:
        process = subprocess.Popen(launch.argv, executable=launch.executable, env=launch.env,
                                   stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                   pass_fds=launch.pass_fds, **as_user(launch.user))
    finally:
        for fd in launch.pass_fds:
            os.close(fd)
    init_pidfd = _open_init(launch)
    if on_start is not None:
        on_start(process)
    try:
        if stdin is not None:
            threading.Thread(target=_feed_stdin, args=(process, stdin), daemon=True).start()
        outputs = {process.stdout: bytearray(), process.stderr: bytearray()}
        cap = int(limits.max_output_bytes)
        timed_out = truncated = False
        stopped: Optional[str] = None
        deadline = started + float(limits.wall_time_s)
        next_watch = started + watch_interval_s
        with selectors.DefaultSelector() as selector:
            for pipe in outputs:
                os.set_blocking(pipe.fileno(), False)
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                if watch is not None and time.monotonic() >= next_watch:
                    stopped = watch()
                    if stopped:
                        break
                    next_watch = time.monotonic() + watch_interval_s
                wait = remaining if watch is None else max(0.0, min(remaining, next_watch - time.monotonic()))
                for key, _ in selector.select(timeout=wait):
                    chunk = key.fileobj.read(_READ_CHUNK)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    kept = outputs[key.fileobj]
                    if len(kept) + len(chunk) > cap:
                        truncated = True
                    kept += chunk[: max(0, cap - len(kept))]
                if truncated:
                    break
        killed = timed_out or truncated or bool(stopped)
        if killed:
            kill_tree(process)
        try:
            returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        except subprocess.TimeoutExpired:  # output closed but the launcher lingers past the deadline
            kill_tree(process)
            returncode = process.wait()
            killed = timed_out = True
        if watch is not None and not stopped:
            stopped = watch()
            killed = killed or bool(stopped)
        exit_code = None if killed else (128 - returncode if returncode < 0 else returncode)
        stderr = bytes(outputs[process.stderr]).decode("utf-8", "replace")
        if stopped:
            stderr += f"\nsandbox: the command was ended: {stopped}\n"
        return RunResult(exit_code=exit_code, stdout=bytes(outputs[process.stdout]).decode("utf-8", "replace"),
                         stderr=stderr, timed_out=timed_out,
                         killed=killed, output_truncated=truncated, duration_s=time.monotonic() - started)
    finally:
        for pipe in (process.stdout, process.stderr):
            pipe.close()
        if process.poll() is None:
            kill_tree(process)
            process.wait()
        if init_pidfd is not None:
            _end_init(init_pidfd)
        if on_exit is not None:
            on_exit(process)
