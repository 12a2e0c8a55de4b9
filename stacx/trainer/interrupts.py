"""SIGTERM and SIGINT become an exception in the driver's main thread, so that the run's teardown
(workers killed, engines and servers closed, staging folders removed) runs before the process exits.

    with stop_on_termination_signals():
        trainer.run()          # a signal raises RunInterrupted inside; run()'s teardown handles it

Why re-install: `ray.init` replaces the SIGTERM handler with `sys.exit` and Ray's core installs a
C-level failure handler that aborts the process, so the trainer installs the handlers again once
Ray is connected (the CLI installs them before, for the start-up phase). Later signals during the
teardown are reported and ignored, so a second Ctrl-C cannot cut it short.

A raised `RunInterrupted` can be lost: a signal that arrives while the main thread runs a callback whose
exceptions Python prints and drops (a fork handler such as the `logging` module's `_releaseLock`, a
finalizer) ends that callback, not the run. So the signal is remembered, not only raised: a later signal
outside the teardown raises again, and `raise_if_interrupted()` at the run's safe points (each step's start,
before each checkpoint) raises it there. Before, a torchrun rank whose launcher died trained on for the
30 s of its parent watch's grace, writing a checkpoint a step.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT reached the driver; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)
        super().__init__(f"received {self.signal_name}")


_received: list[int] = []
"""The first termination signal received while a `stop_on_termination_signals` block runs (nested blocks share
it; the block that opened first forgets it when it ends)."""
_open_blocks = [0]


def _tearing_down() -> bool:
    """Whether the main thread is handling a `RunInterrupted` (an `except` or `finally` block it reached): the
    run's teardown, which a second signal must not cut short."""
    error, seen = sys.exc_info()[1], set()
    while error is not None and id(error) not in seen:
        if isinstance(error, RunInterrupted):
            return True
        seen.add(id(error))
        error = error.__context__
    return False


def raise_if_interrupted() -> None:
    """At a safe point of the run: raise `RunInterrupted` if a signal came and its exception was lost (see the
    module's note). A no-op during the teardown and when no signal came."""
    if _received and not _tearing_down():
        raise RunInterrupted(_received[0])


@contextlib.contextmanager
def stop_on_termination_signals(signals=TERMINATION_SIGNALS):
    """While the block runs, the first of `signals` raises `RunInterrupted`; later ones are reported and
    ignored during the teardown, and raise again outside it (the first one's exception was lost). The
    previous handlers come back afterwards. Outside the main thread this does nothing (only the main
    thread can install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        if _received and _tearing_down():
            print(f"stacx: {signal.Signals(signum).name} again; still stopping the run's workers and servers",
                  file=sys.stderr)
            return
        if not _received:
            _received.append(signum)
        raise RunInterrupted(_received[0])

    previous = {sig: signal.signal(sig, handle) for sig in signals}
    _open_blocks[0] += 1
    try:
        yield
    finally:
        _open_blocks[0] -= 1
        if not _open_blocks[0]:
            _received.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
