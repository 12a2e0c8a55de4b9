"""The suite's warm Python (stacx/testing/warm_python.py): one zygote per pytest process, started on first
use, whose client the end-to-end tests run instead of `sys.executable` for the processes they start
(`stacx train` drivers, torchrun, the shared Ray cluster and, through them, `stacx serve`, the ranks and the
Ray role workers). `STACX_TEST_COLD_PROCESSES=1` turns it off: every process starts cold."""

from __future__ import annotations

import atexit
import os
import sys
import tempfile

COLD_ENV = "STACX_TEST_COLD_PROCESSES"
TESTS = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(TESTS), "examples")
BENCH = os.path.join(os.path.dirname(TESTS), "bench")

_warm = None
REAL_PYTHON = sys.executable
"""The interpreter pytest runs on (`warm_servers_of_in_process_drivers` may point `sys.executable` elsewhere)."""


def warm_python() -> str:
    """The executable to start a Stacx process with: the warm client, or `sys.executable` when turned off."""
    global _warm
    if os.environ.get(COLD_ENV) == "1":
        return REAL_PYTHON
    if _warm is None:
        from stacx.testing.warm_python import start

        folder = tempfile.mkdtemp(prefix="stacx-warm-python-")
        _warm = start(folder, warm_folders=(TESTS, EXAMPLES, BENCH))
        atexit.register(_warm.stop)
    return _warm.client


def torchrun_command() -> list[str]:
    """torchrun, started warm (its ranks are then warm too)."""
    python = warm_python()
    if python == REAL_PYTHON:
        return [os.path.join(os.path.dirname(REAL_PYTHON), "torchrun")]
    return [python, "-m", "torch.distributed.run"]


def warm_servers_of_in_process_drivers(monkeypatch) -> None:
    """For a test that runs a driver inside the pytest process: the `stacx serve` engines its launcher starts
    (`[sys.executable, "-m", "stacx", "serve", ...]`) start warm. Only `sys.executable` changes, for the test."""
    monkeypatch.setattr(sys, "executable", warm_python())


def process_running(pid: int) -> int:
    """The process that runs the command of process `pid`: for a warm client, the zygote's child (the client
    waits for it and relays signals); `pid` itself otherwise."""
    child = _warm.child_of(pid) if _warm is not None else None
    return pid if child is None else child
