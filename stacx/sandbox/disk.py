"""A session's file system: a size- and inode-limited tmpfs on the host where the host may mount one.

    disk = SessionDisk.mount(directory, limits, owner=65534)   # mounts a tmpfs on `directory`, or None
    disk.release()                                             # lazy unmount (MNT_DETACH)

The kernel enforces both bounds: a write past `SandboxLimits.max_disk_bytes` fails with ENOSPC, and
so does creating a file past `max_inodes`, whatever process writes (the bounds hold across the
session's commands, since the tmpfs outlives them). Mounting needs CAP_SYS_ADMIN on the host: a root
host process (the common case, a trainer in a container) has it; elsewhere `mount` returns None and
the session lives in an ordinary folder, bounded only per file (RLIMIT_FSIZE) and per snapshot
(working_copy.SnapshotBounds). The tmpfs is memory-backed: its size is the most RAM (or swap) a session
can hold in files.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Optional

from stacx.sandbox.limits import SandboxLimits

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
FOLDER_INODES = 16
"""Inodes the session's own folders use (root, workspace, tmp, shm...), added to `max_inodes`."""


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
