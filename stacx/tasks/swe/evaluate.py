"""The reward of an SWE task: run its tests in a sandbox after the agent's edits.

One sandboxed command does it all (`_EVALUATE`, a Python script fed a JSON job on stdin):
1. apply the agent's patch (`patch -p1`), when the edits come as a diff;
2. put back the snapshot's version of every file the test patch touches (or delete the file when
   the snapshot has none), so edits to the hidden tests do not count;
3. apply the test patch;
4. exec the task's test command; its output is parsed by the task's `log_format`.
The task is resolved (reward 1.0) when every FAIL_TO_PASS test passed and every PASS_TO_PASS
test passed; a test missing from the output counts as failed.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from typing import Optional

from stacx.sandbox import RunResult, Sandbox, SandboxLimits, SandboxSession
from stacx.tasks.swe.log_parsers import LOG_PARSERS
from stacx.tasks.swe.row import SweTask

AGENT_PATCH_FAILED = 90
TEST_PATCH_FAILED = 91

_EVALUATE = r"""
import json, os, shutil, subprocess, sys
job = json.load(sys.stdin)
def apply(diff, what, code):
    done = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-"],
                          input=diff.encode(), capture_output=True)
    if done.returncode != 0:
        print(f"STACX-SWE: the {what} does not apply:", done.stdout.decode(errors="replace"), flush=True)
        sys.exit(code)
if job["agent_patch"]:
    apply(job["agent_patch"], "agent's patch", %(agent)d)
for path, text in job["restore"].items():
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if text is None:
        continue
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)
if job["test_patch"]:
    apply(job["test_patch"], "test patch", %(test)d)
sys.stdout.flush()
os.execvp("sh", ["sh", "-c", job["test_command"]])
""" % {"agent": AGENT_PATCH_FAILED, "test": TEST_PATCH_FAILED}

_DIFF_TARGET = re.compile(r"^(?:\+\+\+|---) (?:[ab]/)?(\S+)", re.MULTILINE)
_FENCE = re.compile(r"```(?:diff|patch)?\n(.*?)```", re.DOTALL)

DEFAULT_TEST_LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=120, memory_bytes=2 << 30, max_processes=128)
"""Limits of a test run unless the caller gives its own."""


def files_touched(diff: str) -> list[str]:
    """Relative paths a -p1 unified diff reads or writes (its --- and +++ lines, /dev/null left out)."""
    return sorted({path for path in _DIFF_TARGET.findall(diff) if path != "/dev/null"})


def extract_patch(response: str) -> str:
    """The diff in a model's response: the last ```diff fenced block if there is one, else the whole text."""
    blocks = _FENCE.findall(response)
    text = blocks[-1] if blocks else response
    return text if text.endswith("\n") or not text else text + "\n"


@dataclass(frozen=True)
class SweEvaluation:
    instance_id: str
    resolved: bool
    """Every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    test_statuses: dict = field(default_factory=dict)
    """test id -> 'passed' / 'failed' / 'error' / 'skipped' / 'missing', for every listed test."""
    error: Optional[str] = None
    """Why the tests did not run or could not be read (a patch that does not apply, a killed run)."""
    run: Optional[RunResult] = None

    @property
    def reward(self) -> float:
        return float(self.resolved)


def evaluate_session(task: SweTask, session: SandboxSession, *, agent_patch: Optional[str] = None,
                     limits: Optional[SandboxLimits] = None) -> SweEvaluation:
    """Run the task's tests in `session`, whose working copy holds the agent's edits (plus `agent_patch`)."""
    test_patch = task.test_patch or ""
    job = {"agent_patch": agent_patch or "", "test_patch": test_patch, "test_command": task.test_command,
           "restore": {path: task.original_file(path) for path in files_touched(test_patch)}}
    result = session.run(["python3", "-c", _EVALUATE], limits or DEFAULT_TEST_LIMITS, stdin=json.dumps(job).encode())
    log = result.stdout + "\n" + result.stderr
    error = None
    if result.exit_code in (AGENT_PATCH_FAILED, TEST_PATCH_FAILED) and "STACX-SWE:" in result.stdout:
        error = result.stdout.split("STACX-SWE:", 1)[1].strip()[:2000]
    elif result.killed:
        error = "the test run was killed: " + ("wall time" if result.timed_out else "output past the cap")
    elif result.exit_code == 127:
        error = f"a program is missing in the sandbox: {result.stderr.strip()[-500:]}"
    statuses = {} if error else LOG_PARSERS[task.log_format](log)
    listed = {test: statuses.get(test, "missing") for test in task.fail_to_pass + task.pass_to_pass}
    resolved = error is None and all(status == "passed" for status in listed.values())
    return SweEvaluation(task.instance_id, resolved, listed, error, result)


def evaluate_patch(task: SweTask, patch: str, sandbox: Sandbox, *,
                   limits: Optional[SandboxLimits] = None) -> SweEvaluation:
    """Apply `patch` (a -p1 unified diff; empty: no edits) to a fresh copy of the snapshot and run the tests."""
    with sandbox.create(snapshot_source(task)) as session:
        return evaluate_session(task, session, agent_patch=patch, limits=limits)


def snapshot_source(task: SweTask):
    """What `Sandbox.create` takes for the task's snapshot (an in-memory snapshot becomes a tarball)."""
    if not isinstance(task.snapshot, dict):
        return task.snapshot
    return files_tarball(task.snapshot)


def files_tarball(files: dict) -> bytes:
    """A tarball of {relative path: text}."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path, text in sorted(files.items()):
            data = text.encode("utf-8")
            member = tarfile.TarInfo(path)
            member.size, member.mode = len(data), 0o644
            archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()
