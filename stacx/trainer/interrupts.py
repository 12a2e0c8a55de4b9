"""SIGTERM and SIGINT become an exception in the driver's main thread, so that the run's teardown
(workers killed, engines and servers closed, staging folders removed) runs before the process exits.

    with stop_on_termination_signals():
        trainer.run()          # a signal raises RunInterrupted inside; run()'s teardown handles it

Why re-install: `ray.init` replaces the SIGTERM handler with `sys.exit` and Ray's core installs a
C-level failure handler that aborts the process, so the trainer installs the handlers again once
Ray is connected (the CLI installs them before, for the start-up phase). Later signals during the
teardown are reported and ignored, so a second Ctrl-C cannot cut it short.
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


@contextlib.contextmanager
def stop_on_termination_signals(signals=TERMINATION_SIGNALS):
    """While the block runs, the first of `signals` raises `RunInterrupted`; later ones are reported and
    ignored. The previous handlers come back afterwards. Outside the main thread this does nothing
    (only the main thread can install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handle(signum, frame):
        if received:
            print(f"stacx: {signal.Signals(signum).name} again; still stopping the run's workers and servers",
                  file=sys.stderr)
            return
        received.append(signum)
        raise RunInterrupted(signum)

    previous = {sig: signal.signal(sig, handle) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
