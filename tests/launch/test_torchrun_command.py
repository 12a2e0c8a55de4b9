"""`stacx torchrun`: torchrun's arguments pass through as given, and a signal that stopped the run ends it
with 128 + the signal's number and without torchrun's notices and traceback (the launch itself:
tests/launch/test_signals.py)."""

from __future__ import annotations

import logging
import signal

import pytest

from stacx.launch.cli import build_parser
from stacx.launch.commands import torchrun as command


def test_torchruns_own_flags_pass_through_unparsed():
    argv = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "stacx.train", "--algorithm", "sft", "-h"]
    args, extras = build_parser().parse_known_args(argv)
    assert extras == [] and args.torchrun_args == argv[1:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_it_with_128_plus_its_number_and_no_traceback(monkeypatch, signum):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(argv):
        assert argv == ["--standalone", "x.py"]
        raise SignalException("got signal", sigval=signal.Signals(signum))

    monkeypatch.setattr(torchrun, "main", interrupted)
    assert command.run_argv(["--standalone", "x.py"]) == 128 + signum
    monkeypatch.setattr(torchrun, "main", lambda argv: None)
    assert command.run_argv(["x.py"]) == 0


def _record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord("torch.distributed.elastic", logging.WARNING, __file__, 1, message, args, None)


def test_torchruns_signal_notices_are_left_out_and_a_crashs_are_kept():
    notices = command.SignalNotices()
    assert notices.filter(_record("Sending process %s closing signal %s", 7, "SIGTERM"))  # a crash's shutdown
    assert not notices.filter(_record("Received %s death signal, shutting down workers", "SIGINT"))
    assert not notices.filter(_record("Sending process %s closing signal %s", 7, "SIGINT"))
    assert notices.filter(_record("something else"))
