"""The `swe_tests` reward: the response is a patch; the reward is 1.0 when the task's tests resolve it.

    --reward-fn stacx.tasks.swe.reward:swe_tests_reward     (registered as 'swe_tests' once imported)

Each prompt row's metadata holds the task (`swe_task`: a row of the format in `row.py`, or
`swe_builtin`: a built-in task's instance_id) and, optionally, the sandbox setting (`sandbox`: a
SandboxConfig mapping; default: the `namespace` backend). Sandboxes are built once per setting
and shared, so `max_concurrent_runs` bounds the test runs of a whole rollout batch.
"""

from __future__ import annotations

import json
import threading

from stacx.rollout.rewards import register_reward, reward_timeout
from stacx.sandbox import Sandbox, SandboxConfig, build_sandbox
from stacx.tasks.swe.builtin import get_swe_task
from stacx.tasks.swe.evaluate import DEFAULT_TEST_LIMITS, evaluate_patch, extract_patch
from stacx.tasks.swe.row import SweTask

_SANDBOXES: dict[str, Sandbox] = {}
_LOCK = threading.Lock()


def sandbox_for(setting: dict | None) -> Sandbox:
    """The shared sandbox of a setting (a SandboxConfig mapping; None: the defaults)."""
    key = json.dumps(setting or {}, sort_keys=True)
    with _LOCK:
        if key not in _SANDBOXES:
            _SANDBOXES[key] = build_sandbox(SandboxConfig.from_dict(setting or {}))
        return _SANDBOXES[key]


def task_of(metadata: dict) -> SweTask:
    if "swe_task" in metadata:
        return SweTask.from_row(metadata["swe_task"])
    if "swe_builtin" in metadata:
        return get_swe_task(metadata["swe_builtin"])
    raise ValueError("reward swe_tests: the row's metadata has neither 'swe_task' (a task row) nor 'swe_builtin' "
                     "(a built-in task's instance_id)")


@register_reward("swe_tests")
@reward_timeout(DEFAULT_TEST_LIMITS.wall_time_s + 60)
def swe_tests_reward(response: str, label, metadata: dict | None = None) -> float:
    """1.0 when the patch in `response` makes every FAIL_TO_PASS test pass and keeps every PASS_TO_PASS test passing."""
    metadata = metadata or {}
    evaluation = evaluate_patch(task_of(metadata), extract_patch(response), sandbox_for(metadata.get("sandbox")))
    return evaluation.reward
