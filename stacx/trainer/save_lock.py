"""One writer per --save folder: the process that drives a run holds an exclusive lock on the folder
for the run's whole life, so a second run on the same folder is refused, naming the holder.

    with hold_save_folder(run_config.model.save):     # the Ray driver, or torchrun's rank 0
        trainer.run()
    check_save_folder_free(save)                      # preflight (--dry-run too): raises SaveFolderInUse

The lock is `fcntl.flock` on `<save>/.stacx-run.lock`, whose text names the holder (pid, host, start
time). The kernel drops it when the holding process ends however it ends (SIGKILL included), so a
crashed run never leaves the folder locked; a run whose launcher died but whose rank 0 lives on still
holds it (and is named). The file itself stays (removing a lock file races with a process opening it),
except in a folder the run created and saved nothing into: that folder goes, as if the run never had it. A
waiter that had opened the removed file finds it replaced after taking its lock, and locks the file now at
the path (`_lock_the_current_file`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".stacx-run.lock"


class SaveFolderInUse(RuntimeError):
    """Another live process holds the --save folder's lock; the message names it and the fixes."""


def lock_path(save: str | os.PathLike) -> Path:
    return Path(save) / LOCK_NAME


def _holder_text(handle) -> str:
    """'pid N on host H (since ...)' from the lock file's JSON, or what can be said without it."""
    try:
        handle.seek(0)
        holder = json.loads(handle.read() or "null")
    except (OSError, ValueError):
        holder = None
    if not isinstance(holder, dict):
        return "another process (it has not written its pid yet)"
    since = holder.get("started")
    started = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{started}"


def _in_use_error(save, handle) -> SaveFolderInUse:
    return SaveFolderInUse(
        f"--save {save} is in use by another run: {_holder_text(handle)} holds {lock_path(save)}. Two runs writing "
        "one folder overwrite each other's checkpoints: wait for that run to end (or stop it), or choose another --save")


def check_save_folder_free(save: str | os.PathLike | None) -> None:
    """Raise SaveFolderInUse when a live process holds `save`'s lock. Writes nothing (a dry run calls it)."""
    if not save:
        return
    try:
        handle = open(lock_path(save), encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError:  # no lock file (or folder): no run has held it
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a holder's exclusive lock
        except BlockingIOError:
            raise _in_use_error(save, handle) from None
        fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def hold_save_folder(save: str | os.PathLike | None, *, wait_s: float = 0.0, poll_s: float = 0.2):
    """Hold `save`'s exclusive lock while the block runs (creating the folder); SaveFolderInUse when
    another process holds it (for longer than `wait_s`: a restarted rank 0 waits for the process it
    replaces to end). Nothing to hold without --save."""
    if not save:
        yield
        return
    created = not os.path.isdir(save)
    with _lock_the_current_file(save, wait_s, poll_s) as handle:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            if created and os.listdir(save) == [LOCK_NAME]:  # a run that saved nothing leaves no folder behind
                os.unlink(lock_path(save))  # a waiter that opened it finds it replaced, and locks the new one
                try:
                    os.rmdir(save)
                except OSError:  # a waiter made its own lock file there meanwhile: the folder is its now
                    pass
            fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_the_current_file(save, wait_s: float, poll_s: float):
    """The open lock file of `save`, exclusively locked, and still the one at `lock_path(save)`. A holder that
    created the folder and saved nothing removes file and folder as it releases them: a waiter may have opened
    the removed file (its lock would guard nothing) or find the folder gone as it creates it; it tries again."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.makedirs(save, exist_ok=True)
            fd = os.open(lock_path(save), os.O_RDWR | os.O_CREAT, 0o644)
        except (FileExistsError, FileNotFoundError):
            if os.path.lexists(save) and not os.path.isdir(save):
                raise
            continue  # the folder went between the two calls: make it again
        handle = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                error = _in_use_error(save, handle)
                handle.close()
                raise error from None
            handle.close()
            time.sleep(poll_s)
            continue
        if _is_the_file_at(handle, lock_path(save)):
            return handle
        handle.close()  # removed by the holder that released it: lock the file now there


def _is_the_file_at(handle, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)
