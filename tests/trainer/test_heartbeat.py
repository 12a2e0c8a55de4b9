"""A long phase prints a line at least every interval (10 s in a run), naming the phase."""

from __future__ import annotations

import threading

from stacx.trainer.heartbeat import HEARTBEAT_INTERVAL_S, Heartbeat


def test_a_long_phase_beats_with_its_name_and_a_short_one_stays_quiet():
    assert HEARTBEAT_INTERVAL_S <= 10
    lines: list[str] = []
    two_beats = threading.Event()

    def write(line: str) -> None:
        lines.append(line)
        if len(lines) >= 2:
            two_beats.set()

    with Heartbeat("step 3/20", "rollout", interval_s=0.05, write=write) as beat:
        assert two_beats.wait(5.0)  # bounded: the beats come every 0.05 s
        beat.phase = "training policy"
        lines.clear()
        two_beats.clear()
        assert two_beats.wait(5.0)
    assert all(line.startswith("stacx: step 3/20: training policy, ") for line in lines)
    quiet: list[str] = []
    with Heartbeat("step 4/20", "rollout", interval_s=60.0, write=quiet.append):
        pass
    assert quiet == []


def test_a_disabled_heartbeat_never_writes():
    lines: list[str] = []
    with Heartbeat("step 1/2", "rollout", interval_s=0.01, write=lines.append, enabled=False) as beat:
        beat.phase = "training"
    assert lines == [] and beat.line(beat._started + 12.4) == "stacx: step 1/2: training, 12 s"
