"""The job-agent readiness poll, against a stand-in `ray` CLI that answers like the real one."""

from __future__ import annotations

import os
import stat
import time

import pytest

from stacx.testing.ray_jobs import JobAgentNotReadyError, wait_until_jobs_are_accepted

NOT_READY_ANSWER = "No available agent to submit job, please try again later."


def _fake_ray(tmp_path, not_ready_attempts: int, final_exit: int = 0, final_text: str = "succeeded") -> str:
    """A `ray` stand-in: the first `not_ready_attempts` calls answer like a head without an agent. It counts its
    calls in a file replaced whole (a probe killed at the poll's deadline never leaves it empty)."""
    counter = tmp_path / "attempts"
    counter.write_text("0")
    script = tmp_path / "ray"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"n=$(cat {counter}); n=$((n+1)); echo $n > {counter}.$$; mv {counter}.$$ {counter}\n"
        f"if [ $n -le {not_ready_attempts} ]; then echo 'RuntimeError: Request failed with status code 500: "
        f"{NOT_READY_ANSWER}' >&2; exit 1; fi\n"
        f"echo '{final_text}'; exit {final_exit}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _attempts(tmp_path) -> int:
    return int((tmp_path / "attempts").read_text())


def test_polls_until_the_agent_accepts_a_job(tmp_path):
    ray = _fake_ray(tmp_path, not_ready_attempts=3)
    wait_until_jobs_are_accepted(ray, "http://127.0.0.1:1", env=dict(os.environ), timeout_s=30, poll_interval_s=0.01)
    assert _attempts(tmp_path) == 4  # three "no agent" answers, then the accepted probe


def test_times_out_with_the_dashboard_and_last_answer_named(tmp_path):
    ray = _fake_ray(tmp_path, not_ready_attempts=10**6)
    started = time.monotonic()
    with pytest.raises(JobAgentNotReadyError) as err:
        wait_until_jobs_are_accepted(ray, "http://127.0.0.1:1", timeout_s=3.0, poll_interval_s=0.05)
    assert time.monotonic() - started < 30  # bounded: the deadline holds
    assert "http://127.0.0.1:1" in str(err.value) and NOT_READY_ANSWER in str(err.value)
    assert _attempts(tmp_path) >= 2


def test_a_failure_other_than_a_missing_agent_is_raised_at_once(tmp_path):
    ray = _fake_ray(tmp_path, not_ready_attempts=0, final_exit=1, final_text="Authentication failed: bad token")
    with pytest.raises(RuntimeError, match="bad token"):
        wait_until_jobs_are_accepted(ray, "http://127.0.0.1:1", timeout_s=30, poll_interval_s=0.01)
    assert _attempts(tmp_path) == 1
