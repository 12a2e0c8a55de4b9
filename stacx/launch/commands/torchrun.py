"""`stacx torchrun ...`: torchrun, with an interrupted run reported as on Ray.

    stacx torchrun --standalone --nproc-per-node 2 -m stacx.train --algorithm sft ...

Takes torchrun's own arguments unchanged. Plain `torchrun` answers Ctrl-C (or SIGTERM) by signalling
its ranks and then raising its `SignalException`: exit status 1 and a 30-line traceback after the
run's own lines, the same as a crash. Here the ranks stop the same way (rank 0 prints the run's two
lines: what stopped it, and how to resume), torchrun's notices about the signal are left out, and the
exit status is 128 + the signal number (130 for Ctrl-C), the status `stacx train` has on Ray; so a
wrapper script can tell "interrupted, resumable" from "crashed".
"""

from __future__ import annotations

import argparse
import logging
import sys

HELP = "torchrun with Ray's ending on Ctrl-C: exit status 130 and the run's two lines (torchrun's arguments as is)"

ELASTIC_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")
"""torch elastic's loggers that announce a signal's shutdown of the ranks."""


PREFIX_CHARS = "+"
"""Every `-`/`--` argument is torchrun's (`stacx torchrun --help` is torchrun's help)."""


def add_arguments(parser) -> None:
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER, metavar="TORCHRUN_ARGS",
                        help="torchrun's arguments, e.g. --standalone --nproc-per-node 2 -m stacx.train --algorithm sft")


class SignalNotices(logging.Filter):
    """Drops torch elastic's 'Received SIGINT death signal, shutting down workers' and, after it, its
    'Sending process N closing signal SIGINT' lines (a crash's shutdown keeps them)."""

    def __init__(self):
        super().__init__()
        self.signalled = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if "death signal" in message:
            self.signalled = True
            return False
        return not (self.signalled and "closing signal" in message)


def run_argv(argv: list[str]) -> int:
    """torchrun's `main(argv)`; a signal that stopped it returns 128 + its number, without a traceback."""
    # Imported here: torch is slow to import (`stacx --help` stays fast).
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    program, sys.argv[0] = sys.argv[0], "stacx torchrun"  # torchrun's usage line names its program from it
    notices = SignalNotices()
    for name in ELASTIC_LOGGERS:
        logging.getLogger(name).addFilter(notices)
    try:
        torchrun_main(argv)
    except SignalException as err:  # raised once torchrun has stopped its ranks
        return 128 + int(err.sigval)
    finally:
        sys.argv[0] = program
        for name in ELASTIC_LOGGERS:
            logging.getLogger(name).removeFilter(notices)
    return 0


def run(args) -> int:
    return run_argv(list(args.torchrun_args))


if __name__ == "__main__":
    sys.exit(run_argv(sys.argv[1:]))
