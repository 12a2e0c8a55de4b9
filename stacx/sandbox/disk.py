"""A session's file system: a size- and inode-limited tmpfs on the host where the host may mount one.

    disk = SessionDisk.mount(directory, limits, owner=65534)   # mounts a tmpfs on `directory`, or None
    disk.release()                                             # lazy unmount (MNT_DETACH)

The kernel enforces both bounds: a write past `SandboxLimits.max_disk_bytes` fails with ENOSPC, and
so does creating a file past `max_inodes`, whatever process writes (the bounds hold across the
session's commands, since the tmpfs outlives them). Mounting needs CAP_SYS_ADMIN on the host: a root
host process (the common case, a trainer in a container) has it; elsewhere `mount` returns None and
the session lives in an ordinary folder and the bounds are measured instead (`over_bounds`): the
host walks the session's folder every WATCH_INTERVAL_S while a command runs and once when it ends, and
kills the command's tree once either bound is passed. A measured bound can be overshot by what a
command writes between two walks (each file stays bounded by RLIMIT_FSIZE); the tmpfs's cannot. The
tmpfs is memory-backed: its size is the most RAM (or swap) a session can hold in files. A session
closed normally unmounts it; a host process killed with SIGKILL leaves its sessions' tmpfs mounted
(`grep stacx-sandbox /proc/mounts` lists them; `umount -l` each).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
from pathlib import Path
from typing import Optional

from stacx.sandbox.limits import SandboxLimits

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
WATCH_INTERVAL_S = 0.25
"""How often a measured bound is checked while a command runs."""

FOLDER_INODES = 5
"""Inodes of the session's own folders (the tmpfs root, workspace, root, tmp, shm), added to `max_inodes`."""


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class SessionDisk:
    """A mounted, bounded tmpfs; `release()` detaches it (its memory is freed once nothing uses it)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._mounted = True

    @classmethod
    def mount(cls, directory: Path, limits: SandboxLimits, *, owner: Optional[int]) -> Optional["SessionDisk"]:
        """Mount a tmpfs of `limits.max_disk_bytes` bytes and `limits.max_inodes` files on the empty folder
        `directory`, owned by `owner` (mode 0700); None when this process may not mount (not root, or no
        CAP_SYS_ADMIN)."""
        if os.geteuid() != 0:
            return None
        uid = os.getuid() if owner is None else owner
        options = (f"size={int(limits.max_disk_bytes)},nr_inodes={int(limits.max_inodes) + FOLDER_INODES},"
                   f"mode=0700,uid={uid},gid={uid}")
        status = _libc().mount(b"stacx-sandbox", os.fsencode(directory), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                               options.encode())
        if status != 0:
            return None  # EPERM: no CAP_SYS_ADMIN here; the caller falls back to an ordinary folder
        return cls(directory)

    def release(self) -> None:
        """Detach the tmpfs (idempotent); its files are freed once no process holds one open."""
        if self._mounted:
            self._mounted = False
            _libc().umount2(os.fsencode(self.directory), _MNT_DETACH)


def usage(folder: Path) -> tuple[int, int]:
    """(bytes allocated, files and folders) under `folder`, from `du` (links not followed, a hard-linked file
    counted once, a sparse file by what it holds, as on a tmpfs). `du` walks with file descriptors, so no
    nesting deeper than PATH_MAX hides anything from it, as it would from a walk by path."""
    measured = []
    for unit in ("--block-size=1", "--inodes"):
        answer = subprocess.run(["du", "--summarize", "--one-file-system", unit, os.fspath(folder)],
                                capture_output=True, text=True, timeout=60)
        measured.append(int(answer.stdout.split()[0]) if answer.stdout.strip() else 0)
    allocated, entries = measured
    return allocated, max(0, entries - 1)  # du counts `folder` itself


def over_bounds(folder: Path, limits: SandboxLimits) -> Optional[str]:
    """Why `folder` is past the session's bounds (naming the SandboxLimits field), or None."""
    allocated, entries = usage(folder)
    if allocated > limits.max_disk_bytes:
        return (f"the session holds {allocated} bytes on disk, over SandboxLimits.max_disk_bytes = "
                f"{limits.max_disk_bytes}")
    if entries > limits.max_inodes:
        return f"the session holds {entries} files and folders, over SandboxLimits.max_inodes = {limits.max_inodes}"
    return None
