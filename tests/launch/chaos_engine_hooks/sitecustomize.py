"""Loaded at start by every Python process of a chaos run (tests/launch/test_fault_tolerance.py puts this folder on
the run's PYTHONPATH): in its `stacx serve` engines, it installs the `midkill` hold of tests/launch/fault_injection.py
(an engine told to hold stops decoding after a token, until it is killed). Other processes are left alone."""

import sys

if sys.orig_argv[1:4] == ["-m", "stacx", "serve"]:
    from tests.launch.fault_injection import hold_engine_when_asked

    hold_engine_when_asked()
