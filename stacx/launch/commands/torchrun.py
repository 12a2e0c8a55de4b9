"""`stacx torchrun ...`: torchrun, with an interrupted run reported as on Ray.

    stacx torchrun --standalone --nproc-per-node 2 -m stacx.train --algorithm sft ...

Takes torchrun's own arguments unchanged. Plain `torchrun` answers Ctrl-C (or SIGTERM) by signalling
its ranks and then raising its `SignalException`: exit status 1 and a 30-line traceback after the
run's own lines, the same as a crash. Here the ranks stop the same way (rank 0 prints the run's two
lines: what stopped it, and how to resume), torchrun's notices about the signal are left out, and the
exit status is 128 + the signal number (130 for Ctrl-C), the status `stacx train` has on Ray; so a
wrapper script can tell "interrupted, resumable" from "crashed".

The run's `--max-restarts N` (a `stacx train` flag) is handed to torchrun as its own `--max-restarts N`
unless torchrun's arguments give one: torch elastic restarts the ranks after a death, and the restarted
ranks resume the newest checkpoint in --save (stacx.trainer.restarts).
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


MAX_RESTARTS_FLAGS = ("--max-restarts", "--max_restarts")
"""torchrun's flag for its restarts of the ranks, and the run's own (`stacx train --max-restarts`)."""


def _flag_value(args: list[str], flags=MAX_RESTARTS_FLAGS) -> str | None:
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in flags:
            return value if equals else (args[index + 1] if index + 1 < len(args) else None)
    return None


def _script_index(argv: list[str]) -> int | None:
    """Where the training program starts: `stacx.train` after -m, or a script file."""
    for index, arg in enumerate(argv):
        if arg == "stacx.train" or arg.endswith(".py"):
            return index
    return None


def with_elastic_restarts(argv: list[str]) -> list[str]:
    """torchrun's arguments with the run's --max-restarts handed to torch elastic too (so that one flag
    restarts the ranks, which then resume the newest checkpoint themselves), unless torchrun has its own."""
    script = _script_index(argv)
    if script is None or _flag_value(argv[:script]) is not None:
        return argv
    value = _flag_value(argv[script + 1:])
    return ["--max-restarts", value, *argv] if value is not None else argv


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
        torchrun_main(with_elastic_restarts(argv))
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
