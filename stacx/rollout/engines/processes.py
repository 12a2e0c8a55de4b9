"""Server processes a run starts (`stacx serve`, SGLang): waiting for one to be ready, and stopping
one without leaving it behind."""

from __future__ import annotations

import collections
import logging
import subprocess
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 1.0
"""After the process exits, how long its last lines may take to reach the reader."""


class ReadyLineWatch:
    """Reads a server process's output (stdout, stderr merged into it) from a thread, from its
    start: remembers the last lines, finds the `<name> at <url> (ready)` line, then keeps draining
    so a chatty server never blocks on a full pipe.

    `wait(timeout_s)` returns the URL; it raises at once, with the server's last lines, when the
    process exits before it is ready (a broken checkpoint, a bad flag), and after `timeout_s`
    when it neither exits nor becomes ready."""

    TAIL_LINES = 30

    def __init__(self, process: subprocess.Popen, *, name: str):
        self.process, self.name = process, name
        self.tail: collections.deque[str] = collections.deque(maxlen=self.TAIL_LINES)
        self.url: Optional[str] = None
        self._settled = threading.Event()  # the ready line was seen, or the output ended
        threading.Thread(target=self._read, name="server-output", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                line = line.rstrip()
                if self.url is None:
                    self.tail.append(line)
                    if "(ready)" in line and " at " in line:
                        self.url = line.split(" at ", 1)[1].split(" ", 1)[0]
                        self._settled.set()
                else:
                    logger.debug("%s: %s", self.name, line)
        except (ValueError, OSError):  # the pipe was closed under us (the process was stopped)
            pass
        finally:
            self._settled.set()

    def wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._settled.wait(0.1):
            if self.process.poll() is not None:  # exited; a grandchild may still hold the pipe open
                self._settled.wait(EXIT_GRACE_S)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become ready within {timeout_s:.0f}s; its output:\n"
                                   + "\n".join(self.tail))
        if self.url is not None:
            return self.url
        try:
            ended = f"exited with code {self.process.wait(timeout=10)}"
        except subprocess.TimeoutExpired:
            ended = "closed its output"
        raise RuntimeError(f"{self.name} {ended} before it was ready; its output:\n" + "\n".join(self.tail))



class LocalServerGroup:
    """`LaunchedServers` (stacx.rollout.engines.launchers) over local server processes: `processes`, each
    with `wait_until_ready()` (its URL) and `stop()`, ready when every one is and stopped together."""

    def wait_until_ready(self) -> tuple[str, ...]:
        """Every server's URL; when one fails to start, all are stopped before the error goes on."""
        try:
            return tuple(process.wait_until_ready() for process in self.processes)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def stop_process(process: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL and reap it; nothing when it has already exited."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)
