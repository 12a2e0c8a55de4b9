"""The `namespace` backend: Linux user, mount, PID and network namespaces via util-linux, no root.

    unshare --user --map-root-user --net --pid --fork --mount --kill-child  sh -c SETUP
      SETUP (as root of the new user namespace, before the command):
        a tmpfs becomes the new root; /usr (and /bin, /lib... links), the host's dynamic-linker cache
        and `read_only_paths` are bound read-only; the working copy at /workspace read-write; /tmp:
        the session's tmp folder (on its bounded tmpfs), else a private tmpfs bounded in bytes and
        inodes; /dev/{null,zero,random,urandom} only (no /dev/shm); a /proc of the new PID namespace with
        /proc/sys read-only; the PID namespace's pid_max lowered where the kernel allows it;
        pivot_root into it and detach the host's root, then make / read-only;
      then  setpriv (no capabilities, no_new_privs)  prlimit (the limits)  sh -c 'cd /workspace; COMMAND'

What it guarantees: the command sees only those paths (nothing else of the host's file system
exists for it) and can write only the working copy and its own /tmp; its network namespace has a
loopback interface that is down and no other, so no socket reaches anything; it holds no
capabilities, so it cannot remount or unmount anything; the limits are kernel rlimits; the shell
that starts the command is the PID namespace's init, and when it exits or the host kills the
launcher (--kill-child) the kernel kills every process left in the namespace.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from functools import lru_cache

from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.local import (SANDBOX_ENV, LocalSandbox, LocalSession, drop_root_argv, host_runs_as_root, require_tool,
                                 system_paths)
from stacx.sandbox.process import Launch
from stacx.sandbox.protocol import WORKDIR, SandboxUnavailableError

PID_MAX_MIN = 301
"""The kernel's smallest pid_max (it reserves the first 300 PIDs after a wrap-around)."""

_UNSHARE_FLAGS = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--mount", "--kill-child"]


@lru_cache(maxsize=None)
def _probe(launcher_prefix: tuple[str, ...]) -> str:
    """'' when unprivileged namespaces work here for the sandbox's user, else the reason."""
    try:
        probe = subprocess.run([*launcher_prefix, *_UNSHARE_FLAGS, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return "" if probe.returncode == 0 else probe.stderr.decode(errors="replace").strip()


def setup_script(session: LocalSession, read_only_paths: tuple[str, ...], limits: SandboxLimits,
                 setpriv: str, prlimit: str) -> str:
    """The shell script that builds the sandbox's root and starts the command ("$@") inside it."""
    root = shlex.quote(str(session.root_mount))
    if session.disk is not None:  # the session's bounded tmpfs holds /tmp too
        mount_tmp = f'mount --bind {shlex.quote(str(session.tmp_dir))} "$r/tmp"'
    else:
        mount_tmp = (f'mount -t tmpfs -o size={limits.tmp_bytes()},nr_inodes={int(limits.max_inodes)},mode=1777 '
                     'sandbox-tmp "$r/tmp"')
    lines = ["set -e", f"r={root}", 'mount -t tmpfs -o size=16m,mode=755 sandbox-root "$r"']
    for kind, path in system_paths() + [("bind", p) for p in read_only_paths]:
        inside = '"$r"' + shlex.quote(path)
        if kind == "link":
            lines.append(f"ln -s {shlex.quote(os.readlink(path))} {inside}")
            continue
        make = f"mkdir -p {inside}" if os.path.isdir(path) else f'mkdir -p "$(dirname {inside})"; touch {inside}'
        lines += [make, f"mount --rbind {shlex.quote(path)} {inside}", f"mount -o remount,bind,ro {inside}"]
    lines += [
        f'mkdir -p "$r{WORKDIR}" "$r/tmp" "$r/dev" "$r/proc" "$r/.host"',
        f'mount --bind {shlex.quote(str(session.working_copy))} "$r{WORKDIR}"',
        mount_tmp,
        'for d in null zero random urandom; do touch "$r/dev/$d"; mount --bind "/dev/$d" "$r/dev/$d"; done',
        'mount -t proc proc "$r/proc"',
        # Per-namespace pid_max (Linux 6.14+) bounds the process count even where RLIMIT_NPROC does not.
        f'echo {max(PID_MAX_MIN, int(limits.max_processes) + 1)} > "$r/proc/sys/kernel/pid_max" 2>/dev/null || true',
        'mount --bind "$r/proc/sys" "$r/proc/sys"', 'mount -o remount,bind,ro "$r/proc/sys"',
        'cd "$r"', "PATH=/usr/sbin:/sbin:$PATH pivot_root . .host", "umount -l /.host", "rmdir /.host",
        "mount -o remount,bind,ro /",
        # env -i: the shell's own variables (PWD, OLDPWD: host paths) stay out of the command's init.
        f"exec env -i {' '.join(shlex.quote(f'{k}={v}') for k, v in SANDBOX_ENV.items())} "
        f"{shlex.quote(setpriv)} --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- "
        f"{shlex.quote(prlimit)} {' '.join(limits.prlimit_args())} -- "
        f"sh -c 'cd {WORKDIR} || exit 125; \"$@\"; exit $?' sandbox \"$@\"",
    ]
    return "\n".join(lines)


class NamespaceSandbox(LocalSandbox):
    """Sandboxes from unprivileged Linux namespaces (util-linux `unshare`, `setpriv`, `prlimit`)."""

    name = "namespace"

    def __init__(self, **kwargs):
        fix = "install util-linux, or set sandbox.backend to 'bubblewrap' or 'remote'"
        self.unshare = require_tool("unshare", self.name, fix)
        self.prlimit = require_tool("prlimit", self.name, fix)
        self.setpriv_inside = require_tool("setpriv", self.name, fix)
        super().__init__(**kwargs)
        as_user = [self.setpriv, *drop_root_argv()] if host_runs_as_root() else []
        reason = _probe((*as_user, self.unshare))
        if reason:
            raise SandboxUnavailableError(
                f"sandbox backend 'namespace' (setting sandbox.backend) needs unprivileged user namespaces, and "
                f"`unshare --user --map-root-user --net --pid --mount` failed here: {reason}; enable them "
                "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0), or set sandbox.backend "
                "to 'remote'")

    def launch(self, session: LocalSession, command: list[str], limits: SandboxLimits) -> Launch:
        script = setup_script(session, self.read_only_paths, limits, self.setpriv_inside, self.prlimit)
        # unshare --fork waits for the namespace's init, which ends only after its whole namespace. The init
        # (PID 1) ends up as the command's shell: its /proc/1/cmdline is the command, its environ SANDBOX_ENV.
        return Launch([self.unshare, *_UNSHARE_FLAGS, "sh", "-c", script, "sandbox-setup", *command],
                      env=dict(SANDBOX_ENV))
