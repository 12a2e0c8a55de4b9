"""A process a run starts ends when the process that started it dies, however that one dies.

    end_with_launcher()            # a torchrun rank: the launcher's agent is its parent
    end_with_parent(parent_pid)    # `stacx serve --parent-pid`: the run's driver

torch elastic starts every rank in its own session, so a SIGKILLed `torchrun` (even `kill -9 -- -PGID`)
leaves its ranks running, and they keep writing checkpoints. Two mechanisms, standard library only:
- `PR_SET_PDEATHSIG` (Linux `prctl` through ctypes), for torchrun ranks: the kernel sends SIGTERM the
  moment the parent dies, so the rank's own teardown runs (`stacx.trainer.interrupts`); it fires when the
  forking *thread* exits, so a server started from a thread relies on the watch below alone;
- a daemon thread that watches the parent (every PARENT_POLL_S), for systems without `prctl` and for a
  parent given by pid; it sends SIGTERM too, and SIGKILL when the process is still there
  TEARDOWN_GRACE_S later (a teardown stuck in a collective whose peers are gone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from typing import Callable

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
"""Seconds between two looks at the parent."""
TEARDOWN_GRACE_S = 30.0
"""Seconds a process has for its teardown after its parent died, before it is killed."""


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(environ=None) -> bool:
    """True when torchrun (or another launcher setting its variables) started this process."""
    environ = os.environ if environ is None else environ
    has_rank_env = all(name in environ for name in TORCHRUN_ENV)
    return has_rank_env and ("TORCHELASTIC_RUN_ID" in environ or "LOCAL_WORLD_SIZE" in environ)


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies; False where `prctl` is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_is_alive(parent_pid: int, was_child: bool) -> bool:
    """Whether `parent_pid` still runs. A child's dead parent re-parents it (kill(pid, 0) would still
    find the parent's zombie, or a new process under a reused pid), so a child compares getppid()."""
    if was_child:
        return os.getppid() == parent_pid
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _kill_self(signum: int) -> None:
    os.kill(os.getpid(), signum)


def watch_parent(parent_pid: int, *, poll_s: float = PARENT_POLL_S, grace_s: float | None = TEARDOWN_GRACE_S,
                 on_gone: Callable[[int], None] = _kill_self, name: str = "stacx-parent-watch") -> threading.Thread:
    """A daemon thread that calls `on_gone(SIGTERM)` once `parent_pid` is gone, then `on_gone(SIGKILL)`
    if this process is still running `grace_s` later (None: never). Raises ProcessLookupError when
    the parent is already gone."""
    was_child = os.getppid() == parent_pid
    if not parent_is_alive(parent_pid, was_child):
        raise ProcessLookupError(f"process {parent_pid} is not running")
    stop = threading.Event()

    def watch():
        while parent_is_alive(parent_pid, was_child):
            if stop.wait(poll_s):
                return
        on_gone(signal.SIGTERM)
        if grace_s is not None and not stop.wait(grace_s):
            on_gone(signal.SIGKILL)

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.stop = stop  # tests end the watch with thread.stop.set()
    thread.start()
    return thread


def end_with_parent(parent_pid: int, *, grace_s: float | None = TEARDOWN_GRACE_S,
                    death_signal: bool = False) -> threading.Thread:
    """SIGTERM this process when `parent_pid` ends (a watch thread; with `death_signal`, also the kernel's
    death signal when it is the direct parent), SIGKILL `grace_s` later if it is still there.

    The kernel sends the death signal when the parent *thread* that forked this process exits, not the
    parent process: a server a driver starts from a short-lived thread (the engine pool starts its servers
    in threads) would be killed while its driver runs. So only a caller whose parent forks from a thread
    that lives as long as the process asks for it (a torchrun rank: the elastic agent's main loop)."""
    if death_signal and os.getppid() == parent_pid:
        set_parent_death_signal(signal.SIGTERM)
    return watch_parent(parent_pid, grace_s=grace_s)


_launcher_watch: list[threading.Thread] = []
"""The watch `end_with_launcher` started (at most one per process)."""


def end_with_launcher() -> threading.Thread:
    """End this torchrun rank when its launcher (the elastic agent, its parent) dies. Call it as early as
    possible (`stacx train` does before its preflight): the launcher is known only while it is the parent.
    A second call returns the first call's watch."""
    if not _launcher_watch:
        _launcher_watch.append(end_with_parent(os.getppid(), death_signal=True))
    return _launcher_watch[0]
