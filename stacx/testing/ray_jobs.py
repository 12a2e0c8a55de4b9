"""Wait until a Ray cluster accepts `ray job submit`, with a bounded deadline.

`ray start --head` prints "Ray runtime started" before the head node's dashboard agent has
registered with the job head. Until it has, every submission fails with "No available agent to
submit job, please try again later" (the job head waits only ~10 s for the agent per request). On
a loaded 2-core machine registration can take longer than that, so a job submitted right after
`ray start` fails at random. The only faithful readiness signal is a submission that is accepted
and runs, so this polls with a trivial job:

    wait_until_jobs_are_accepted(ray_executable, "http://127.0.0.1:8265", env=env, timeout_s=180)

Each attempt is itself bounded (`attempt_timeout_s`); a failure other than "no agent yet" (bad
address, auth, a job that fails) is raised at once with the CLI's output, never retried.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Mapping

AGENT_NOT_READY_MARKERS = ("No available agent", "Failed to get head node agent")
"""What the job head answers while the head node's agent has not registered yet."""

PROBE_JOB_ENTRYPOINT = (sys.executable, "-c", "pass")


class JobAgentNotReadyError(TimeoutError):
    """The cluster did not accept a job before the deadline."""


def _submit_probe_job(ray_executable: str, dashboard_url: str, env: Mapping[str, str] | None,
                      attempt_timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ray_executable, "job", "submit", f"--address={dashboard_url}", "--", *PROBE_JOB_ENTRYPOINT],
        env=None if env is None else dict(env), capture_output=True, text=True, timeout=attempt_timeout_s,
    )


def wait_until_jobs_are_accepted(
    ray_executable: str,
    dashboard_url: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 180.0,
    attempt_timeout_s: float = 60.0,
    poll_interval_s: float = 1.0,
) -> float:
    """Submit a trivial job until one is accepted and succeeds; returns the seconds it took.

    Raises `JobAgentNotReadyError` (naming the dashboard and the last answer) when no job was
    accepted within `timeout_s`, and `RuntimeError` at once for any other failure.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last_output = ""
    num_attempts = num_timed_out = 0
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            break
        num_attempts += 1
        try:
            completed = _submit_probe_job(ray_executable, dashboard_url, env, min(attempt_timeout_s, remaining_s))
        except subprocess.TimeoutExpired:
            num_timed_out += 1  # keep the last real answer: it says more than a cut-off attempt
            continue
        output = (completed.stdout or "") + (completed.stderr or "")
        if completed.returncode == 0:
            return time.monotonic() - started
        if not any(marker in output for marker in AGENT_NOT_READY_MARKERS):
            raise RuntimeError(
                f"`ray job submit --address={dashboard_url}` failed with exit code {completed.returncode} "
                f"for a reason other than a job agent that is not ready yet:\n{output[-3000:]}"
            )
        last_output = output
        time.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))
    raise JobAgentNotReadyError(
        f"the Ray cluster at {dashboard_url} accepted no job within {timeout_s:.0f} s ({num_attempts} probe "
        f"submissions, {num_timed_out} of them cut off by their own timeout): its head node's dashboard "
        f"agent never served the job head. Last answer:\n{last_output[-2000:] or '(none)'}"
    )
