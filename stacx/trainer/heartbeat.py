"""A line on stderr at least every 10 s while a long phase runs, so a quiet run never looks hung.

    with Heartbeat("starting the role workers") as beat:
        ...
        beat.phase = "loading checkpoints"       # the next line names the new phase

Nothing is printed for a phase that ends within `interval_s`. Lines go through `tqdm.write`, which
keeps an active progress bar below them intact:

    stacx: step 3/20: rollout, 10 s (20 s in this step)
    stacx: step 3/20: rollout, 620 s; waiting for 1 agent episode: rows.jsonl:4 (620 s)
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

from tqdm import tqdm

HEARTBEAT_INTERVAL_S = 10.0
"""Longest quiet time of a running phase."""


def _write_to_stderr(line: str) -> None:
    tqdm.write(line, file=sys.stderr)


class Heartbeat:
    """Prints '<prefix>: <phase>, N s (M s in <prefix>)' every `interval_s` while the with-block runs."""

    def __init__(self, prefix: str, phase: str = "", *, interval_s: float = HEARTBEAT_INTERVAL_S,
                 write: Optional[Callable[[str], None]] = None, enabled: bool = True,
                 detail: Optional[Callable[[], str]] = None):
        """detail: what the phase waits for, appended after '; ' when not empty (e.g. the agent episodes
        still running, AgentRollout.waiting_for)."""
        self.prefix = prefix
        self.detail = detail
        self.interval_s = interval_s
        self.enabled = enabled
        self._write = write or _write_to_stderr
        self._phase = phase
        self._phase_started = self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase, self._phase_started = phase, time.monotonic()

    def line(self, now: float) -> str:
        total = now - self._started
        if not self._phase:
            line = f"stacx: {self.prefix}, {total:.0f} s"
        else:
            in_phase = now - self._phase_started
            whole = f" ({total:.0f} s in all)" if total - in_phase >= 1 else ""
            line = f"stacx: {self.prefix}: {self._phase}, {in_phase:.0f} s{whole}"
        detail = self.detail() if self.detail is not None else ""
        return f"{line}; {detail}" if detail else line

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write(self.line(time.monotonic()))

    def __enter__(self) -> "Heartbeat":
        self._started = self._phase_started = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, name="stacx-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
