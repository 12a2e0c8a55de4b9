"""The reward of an SWE task: its tests, run in a fresh copy of the snapshot with the agent's edits.

    evaluate_patch(task, patch, sandbox)        single-turn: the edits are a diff
    evaluate_session(task, session, sandbox)    multi-turn: the edits are what changed in the agent's session

Either way the tests never run where the agent worked. A new sandbox session is made from the task's
snapshot and one sandboxed command, the judge (`judge.py`, passed as `python3 -I -S -c`, never a file of
the copy), does the rest: it applies the agent's edits to non-test files only and puts every test file
back as the snapshot had it (the rule: `judge.is_test_path` plus `task_test_files`), applies the hidden
test patch, runs the tests in an isolated child interpreter, and prints one report line that carries a
secret made for this evaluation. The task is resolved (reward 1.0) when every FAIL_TO_PASS and every
PASS_TO_PASS test passed; a test missing from the report counts as not passed.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import secrets
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from stacx.sandbox import RunResult, Sandbox, SandboxLimits, SandboxSession
from stacx.tasks.swe import judge
from stacx.tasks.swe.log_parsers import LOG_PARSERS
from stacx.tasks.swe.row import SweTask

JUDGE_SOURCE = Path(judge.__file__).read_text(encoding="utf-8")
"""The judge's text, passed on the sandboxed command line."""

_DIFF_TARGET = re.compile(r"^(?:\+\+\+|---) (?:[ab]/)?(\S+)", re.MULTILINE)
_FENCE = re.compile(r"```(?:diff|patch)?\n(.*?)```", re.DOTALL)

DEFAULT_TEST_LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=120, memory_bytes=2 << 30, max_processes=128)
"""Limits of a test run unless the caller gives its own."""

MAX_EDIT_BYTES = 64 << 20
"""Largest export of an agent's edits from its session (base64 JSON); larger edits earn 0 with the reason."""

_UNITTEST_FLAGS = {"-v", "--verbose", "-q", "--quiet", "-b", "--buffer", "-f", "--failfast", "-c", "--catch",
                   "--locals"}


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
    """Why the tests did not run or cannot be believed (a patch that does not apply, a killed run, a test
    framework modified by the tested code)."""
    run: Optional[RunResult] = None
    dropped: tuple[str, ...] = ()
    """Test files the agent's edits touched: not applied (the snapshot's version was tested)."""
    runner: str = "unittest"
    """'unittest' (each listed test run and recorded by the judge) or 'command' (the test command's log parsed)."""
    log: str = ""
    """The end of the tests' output (what the tested code printed; never read for the verdict of a 'unittest' run)."""

    @property
    def reward(self) -> float:
        return float(self.resolved)


@dataclass(frozen=True)
class AgentEdits:
    """What the agent changed: a diff (single-turn), or files and deletions (exported from its session)."""

    patch: str = ""
    """A -p1 unified diff."""
    files: dict = field(default_factory=dict)
    """Relative path -> the file's new bytes."""
    deleted: tuple[str, ...] = ()
    """Relative paths of the snapshot's files the agent removed."""


def runner_of(task: SweTask) -> str:
    """'unittest' when the judge runs the listed tests itself (log format unittest and a command that is
    `python3 -m unittest` with flags only or `discover` with no options); else 'command'."""
    try:
        words = shlex.split(task.test_command)
    except ValueError:
        return "command"
    python = words[:1] and re.fullmatch(r"python(3(\.\d+)?)?", os.path.basename(words[0]))
    if task.log_format != "unittest" or not python or words[1:3] != ["-m", "unittest"]:
        return "command"
    rest = [word for word in words[3:] if word not in _UNITTEST_FLAGS]
    return "unittest" if rest in ([], ["discover"]) else "command"


def task_test_files(task: SweTask) -> list[str]:
    """The task's own test files besides those `judge.is_test_path` names: the files the test patch touches,
    the file of every listed test, and the `__init__.py` of the folder that holds it (the package the test
    module is imported through)."""
    found = set(files_touched(task.test_patch or ""))
    for test in task.fail_to_pass + task.pass_to_pass:
        if "::" in test or test.endswith(".py"):  # pytest: tests/test_x.py::test_a
            files = [test.split("::", 1)[0]]
        else:  # unittest: every dotted prefix may be the module (tests.test_core.TestCore.test_x)
            parts = test.split(".")
            files = ["/".join(parts[:k]) + ".py" for k in range(1, len(parts))]
        for path in files:
            found.add(path)
            if "/" in path:
                found.add(path.rsplit("/", 1)[0] + "/__init__.py")
    return sorted(found)


def snapshot_manifest(task: SweTask) -> dict[str, str]:
    """Relative path -> sha256 of every regular file of the snapshot (what an agent's edits are compared to)."""
    digest = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    if isinstance(task.snapshot, dict):
        return {path: digest(text.encode("utf-8")) for path, text in task.snapshot.items()}
    root = Path(task.snapshot)
    if root.is_dir():
        return {path: digest((root / path).read_bytes()) for path in judge.walk_files(str(root))}
    manifest = {}
    with tarfile.open(root, mode="r:*") as archive:
        for member in archive.getmembers():
            if member.isfile():
                manifest[os.path.normpath(member.name)] = digest(archive.extractfile(member).read())
    return manifest


def export_edits(task: SweTask, session: SandboxSession, *, limits: Optional[SandboxLimits] = None) -> AgentEdits:
    """The agent's edits in `session`: the files that differ from the snapshot's, and the ones it deleted
    (links, special files, .git and __pycache__ are not carried). ValueError when they cannot be read."""
    limits = limits or DEFAULT_TEST_LIMITS
    limits = SandboxLimits(**{**limits.to_dict(), "max_output_bytes": MAX_EDIT_BYTES})
    result = session.run(["python3", "-I", "-S", "-c", JUDGE_SOURCE, "export"], limits,
                         stdin=json.dumps(snapshot_manifest(task)).encode())
    if not result.ok:
        raise ValueError(f"the agent's edits could not be read from its session (exit {result.exit_code}, "
                         f"{'output past ' + str(MAX_EDIT_BYTES) + ' bytes' if result.output_truncated else ''}"
                         f"{result.stderr.strip()[-500:]})")
    exported = json.loads(result.stdout)
    return AgentEdits(files={path: base64.b64decode(data) for path, data in exported["files"].items()},
                      deleted=tuple(exported["deleted"]))


def evaluate_edits(task: SweTask, edits: AgentEdits, sandbox: Sandbox, *,
                   limits: Optional[SandboxLimits] = None) -> SweEvaluation:
    """Make a fresh copy of the snapshot in `sandbox`, apply `edits` to its non-test files, restore its test
    files, apply the test patch and run the tests (the module doc)."""
    limits = limits or DEFAULT_TEST_LIMITS
    runner, secret = runner_of(task), secrets.token_hex(16)
    job = {"secret": secret, "judge_source": JUDGE_SOURCE, "runner": runner, "test_command": task.test_command,
           "tests": list(task.fail_to_pass + task.pass_to_pass), "test_files": task_test_files(task),
           "test_patch": task.test_patch or "", "timeout_s": max(1.0, 0.9 * float(limits.wall_time_s) - 2),
           "edits": {"patch": edits.patch, "deleted": list(edits.deleted),
                     "files": {path: base64.b64encode(data).decode() for path, data in edits.files.items()}}}
    with sandbox.create(snapshot_source(task)) as session:
        result = session.run(["python3", "-I", "-S", "-c", JUDGE_SOURCE, "judge"], limits,
                             stdin=json.dumps(job).encode())
    marker = f"{judge.REPORT_PREFIX} {secret} "
    reports = [line[len(marker):] for line in result.stdout.splitlines() if line.startswith(marker)]
    report, error = {}, None
    if result.killed:
        error = "the test run was killed: " + ("wall time" if result.timed_out else "output past the cap")
    elif len(reports) != 1:
        error = (f"the judge wrote {len(reports)} reports (exit status {result.exit_code}): "
                 f"{result.stderr.strip()[-1000:]}")
    else:
        try:
            report = json.loads(reports[0])
            error = report.get("error")
        except (ValueError, AttributeError):  # a line the tests' processes wrote into it
            report, error = {}, "the judge's report line is not readable JSON"
    if error is None and runner == "unittest":
        statuses = report["statuses"]
    elif error is None:
        statuses = LOG_PARSERS[task.log_format](report["log"])
    else:
        statuses = {}
    listed = {test: statuses.get(test, "missing") for test in task.fail_to_pass + task.pass_to_pass}
    resolved = error is None and all(status == "passed" for status in listed.values())
    return SweEvaluation(task.instance_id, resolved, listed, error, result, tuple(report.get("dropped", ())), runner,
                         report.get("log", ""))


def evaluate_patch(task: SweTask, patch: str, sandbox: Sandbox, *,
                   limits: Optional[SandboxLimits] = None) -> SweEvaluation:
    """The single-turn reward's evaluation: `patch` (a -p1 unified diff; empty: no edits) as the agent's edits."""
    return evaluate_edits(task, AgentEdits(patch=patch), sandbox, limits=limits)


def evaluate_session(task: SweTask, session: SandboxSession, sandbox: Sandbox, *,
                     limits: Optional[SandboxLimits] = None) -> SweEvaluation:
    """The multi-turn evaluation: what the agent changed in `session`, evaluated in a fresh copy from `sandbox`."""
    try:
        edits = export_edits(task, session, limits=limits)
    except ValueError as error:
        return SweEvaluation(task.instance_id, False, {t: "missing" for t in task.fail_to_pass + task.pass_to_pass},
                             str(error), runner=runner_of(task))
    return evaluate_edits(task, edits, sandbox, limits=limits)


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
