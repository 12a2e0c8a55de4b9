"""What the two local backends share: the session (working copy, live launchers, close) and the host user.

A backend subclass writes only `launch`: the host command that enters the sandbox and runs
the user's command in `/workspace` under the kernel-enforced limits. Every launcher starts with
SANDBOX_ENV as its whole environment (never the host's). When the host runs as root, every
launcher runs as SANDBOX_UID_WHEN_ROOT (the ids are dropped in the child before it executes the
launcher): a user namespace then maps the sandbox's root to that unprivileged user, so RLIMIT_NPROC
applies (the kernel exempts the real root from it) and nothing the sandbox reaches is writable except
what that user owns.

A session's folder holds `workspace/` (the working copy), `tmp/` and `shm/`; where the host may
mount, the folder is a tmpfs bounded by `max_disk_bytes` and `max_inodes` (stacx.sandbox.disk).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

from stacx.sandbox.disk import WATCH_INTERVAL_S, SessionDisk, over_bounds
from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.process import Launch, RunSlots, kill_tree, run_launcher
from stacx.sandbox.protocol import ClosedOnExit, Command, RunResult, SandboxClosedError, SandboxUnavailableError, Source
from stacx.sandbox.working_copy import give_to, make_working_copy

SANDBOX_UID_WHEN_ROOT = 65534
"""The host user (nobody) sandboxes run as when the host process is root."""

SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
"""The whole environment of a sandboxed command (nothing of the host's environment leaks in)."""


def host_runs_as_root() -> bool:
    return os.geteuid() == 0


def sandbox_user() -> Optional[int]:
    """The host uid launchers run as: SANDBOX_UID_WHEN_ROOT when this process is root, else None (its own)."""
    return SANDBOX_UID_WHEN_ROOT if host_runs_as_root() else None


def drop_root_argv() -> list[str]:
    """`setpriv` options that make a root launcher run as SANDBOX_UID_WHEN_ROOT, without supplementary groups."""
    return [f"--reuid={SANDBOX_UID_WHEN_ROOT}", f"--regid={SANDBOX_UID_WHEN_ROOT}", "--clear-groups", "--"]


def require_tool(name: str, backend: str, fix: str) -> str:
    """The absolute path of the host program `name`, or SandboxUnavailableError naming the setting."""
    path = shutil.which(name)
    if path is None:
        raise SandboxUnavailableError(f"sandbox backend {backend!r} (setting sandbox.backend) needs the program "
                                      f"{name!r}, which is not on PATH; {fix}")
    return path


def as_argv(command: Command) -> list[str]:
    if isinstance(command, str):
        return ["sh", "-c", command]
    if not command or not all(isinstance(part, str) for part in command):
        raise ValueError(f"sandbox command must be a shell string or a non-empty list of strings, got {command!r}")
    return list(command)


class LocalSession(ClosedOnExit):
    """A working copy in a private host folder and the launchers running in it."""

    def __init__(self, sandbox: "LocalSandbox", source: Source):
        self._sandbox = sandbox
        self.directory = Path(tempfile.mkdtemp(prefix="stacx-sandbox-", dir=sandbox.scratch_dir))
        self.working_copy = self.directory / "workspace"
        self.root_mount = self.directory / "root"
        self.tmp_dir = self.directory / "tmp"
        self.shm_dir = self.directory / "shm"
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.disk: Optional[SessionDisk] = None
        """The session's bounded tmpfs, or None where the host may not mount (then the bounds are measured while
        each command runs)."""
        limits = sandbox.default_limits
        try:
            self.disk = SessionDisk.mount(self.directory, limits, owner=sandbox_user())
            for folder in (self.working_copy, self.root_mount, self.tmp_dir, self.shm_dir):
                folder.mkdir()
            make_working_copy(source, self.working_copy, limits)
            if host_runs_as_root():  # the sandbox user must reach its working copy, and nobody else
                give_to(self.directory, SANDBOX_UID_WHEN_ROOT, SANDBOX_UID_WHEN_ROOT)
        except BaseException:
            self._remove()
            raise

    def run(self, command: Command, limits: Optional[SandboxLimits] = None, *,
            stdin: Optional[bytes] = None) -> RunResult:
        if self._closed:
            raise SandboxClosedError("this sandbox session is closed; create a new one")
        limits = limits or self._sandbox.default_limits
        with self._sandbox.slots.slot():
            launch = self._sandbox.launch(self, as_argv(command), limits)
            launch.user = sandbox_user()
            return run_launcher(launch, limits, stdin=stdin, on_start=self._started, on_exit=self._exited,
                                watch=self._measured_bounds(), watch_interval_s=WATCH_INTERVAL_S)

    def _measured_bounds(self):
        """Without a bounded tmpfs, the session's bounds are measured while each command runs (disk.over_bounds)."""
        if self.disk is not None:
            return None
        bounds = self._sandbox.default_limits
        return lambda: over_bounds(self.directory, bounds)

    def _started(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._live.add(process)
        if self._closed:  # close() ran while this launcher was starting
            kill_tree(process)

    def _exited(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._live.discard(process)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            live = list(self._live)
        for process in live:
            kill_tree(process)
        for process in live:
            process.wait()
        self._remove()

    def _remove(self) -> None:
        if self.disk is not None:
            self.disk.release()
        shutil.rmtree(self.directory, ignore_errors=True)


class LocalSandbox:
    """Base of the local backends: sessions, the run slots, the default limits."""

    name = "local"

    def __init__(self, *, default_limits: SandboxLimits, slots: RunSlots, read_only_paths: tuple[str, ...] = (),
                 scratch_dir: Optional[str] = None):
        self.default_limits = default_limits
        self.slots = slots
        missing = [path for path in read_only_paths if not os.path.exists(path)]
        if missing:
            raise ValueError(f"sandbox.read_only_paths names {', '.join(missing)}, which does not exist on this host")
        self.read_only_paths = tuple(read_only_paths)
        self.scratch_dir = scratch_dir
        self.setpriv = require_tool("setpriv", self.name, "install util-linux") if host_runs_as_root() else "setpriv"

    def create(self, source: Source) -> LocalSession:
        return LocalSession(self, source)

    def launch(self, session: LocalSession, command: list[str], limits: SandboxLimits) -> Launch:
        """The launcher that runs `command` in `session`'s working copy under `limits`."""
        raise NotImplementedError


def system_paths() -> list[tuple[str, str]]:
    """(kind, path) of what a command needs from the host, read-only: 'bind' for a folder, 'link' for a
    top-level symlink such as /bin -> usr/bin (merged-/usr systems)."""
    found = [("bind", "/usr")]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(top):
            found.append(("link", top))
        elif os.path.isdir(top):
            found.append(("bind", top))
    for path in ("/etc/ld.so.cache", "/etc/alternatives"):
        if os.path.exists(path):
            found.append(("bind", path))
    return found
