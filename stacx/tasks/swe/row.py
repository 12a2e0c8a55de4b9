"""The SWE task row, modelled on SWE-bench / SWE-Gym.

    {"instance_id": "mathkit__sum_up_to",
     "problem_statement": "sum_up_to(4) returns 6; expected 10 ...",
     "snapshot": "repos/mathkit" | "repos/mathkit.tar.gz" | {"path/in/repo.py": "file text", ...},
     "test_command": "python3 -m unittest -v",
     "test_patch": "--- a/tests/test_x.py\n+++ b/tests/test_x.py\n...",      (optional: hidden tests)
     "FAIL_TO_PASS": ["tests.test_x.TestX.test_new"],   (a list, or SWE-bench's JSON-encoded list)
     "PASS_TO_PASS": ["tests.test_core.TestCore.test_old"],
     "log_format": "unittest" | "pytest",
     "patch": "..."}                                    (optional: the reference fix, as in SWE-bench)

The agent sees the snapshot and the problem statement, never `test_patch`. The evaluation
(evaluate.py) applies the agent's edits to the non-test files of a fresh copy, puts every test file
back (the ones `test_patch` adds included), and runs the tests; the task is resolved when every
FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes.
"""

from __future__ import annotations

import json
import os
import posixpath
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from stacx.tasks.swe.log_parsers import LOG_PARSERS

Snapshot = Union[str, dict]
"""A folder, a .tar / .tar.gz file, or {relative path: file text}."""


SNAPSHOT_ROOTS_ENV = "STACX_SWE_SNAPSHOT_ROOTS"
"""Folders (separated by os.pathsep) a task row's snapshot folder or tarball may be in; default: the working
directory and the temporary folder."""


def snapshot_roots() -> list[Path]:
    """The folders a snapshot path may resolve into (`SNAPSHOT_ROOTS_ENV`, else the working and temp folders)."""
    configured = [part for part in os.environ.get(SNAPSHOT_ROOTS_ENV, "").split(os.pathsep) if part.strip()]
    return [Path(root).resolve() for root in (configured or [os.getcwd(), tempfile.gettempdir()])]


def check_snapshot_root(snapshot: str, where: str) -> None:
    """A row names a host folder the sandbox copies for the model to read: it must resolve (links followed)
    inside one of `snapshot_roots()`, so a dataset row cannot hand the model ~/.ssh or /etc."""
    resolved = Path(snapshot).resolve()
    roots = snapshot_roots()
    if not any(resolved == root or root in resolved.parents for root in roots):
        raise ValueError(f"{where}: snapshot {snapshot!r} ({resolved}) is outside the folders snapshots may come from "
                         f"({', '.join(str(root) for root in roots)}); move the repository under one of them, or list "
                         f"its folder in {SNAPSHOT_ROOTS_ENV} (separated by '{os.pathsep}')")


def _test_list(row: dict, key: str) -> tuple[str, ...]:
    value = row.get(key, [])
    if isinstance(value, str):  # SWE-bench stores these lists JSON-encoded
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"SWE task {row.get('instance_id')!r}: {key} is a string but not a JSON list") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"SWE task {row.get('instance_id')!r}: {key} must be a list of test ids, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class SweTask:
    instance_id: str
    """Unique name of the task."""
    problem_statement: str
    """The issue text the agent is given."""
    snapshot: Snapshot
    """The repository before the fix: a folder, a tarball, or {relative path: text}."""
    test_command: str
    """Shell command run in the repository's root that runs the tests (its output is parsed by `log_format`)."""
    fail_to_pass: tuple[str, ...]
    """Tests that fail on the snapshot and must pass after the fix."""
    pass_to_pass: tuple[str, ...] = ()
    """Tests that pass on the snapshot and must keep passing."""
    test_patch: Optional[str] = None
    """Unified diff (-p1) adding the hidden tests, applied after the agent's edits."""
    log_format: str = "unittest"
    """How to read the test command's output: one of LOG_PARSERS."""
    reference_patch: Optional[str] = None
    """The known fix (unified diff, -p1), if any."""
    metadata: dict = field(default_factory=dict, compare=False)
    """Anything else of the row (family, repository name, ...)."""

    def __post_init__(self) -> None:
        where = f"SWE task {self.instance_id!r}"
        if not self.instance_id:
            raise ValueError("SWE task: instance_id is empty")
        if not self.fail_to_pass:
            raise ValueError(f"{where}: FAIL_TO_PASS is empty; a task needs at least one test the fix makes pass")
        if not self.test_command.strip():
            raise ValueError(f"{where}: test_command is empty")
        if self.log_format not in LOG_PARSERS:
            raise ValueError(f"{where}: log_format {self.log_format!r} is not one of {', '.join(sorted(LOG_PARSERS))}")
        if isinstance(self.snapshot, dict):
            for path, text in self.snapshot.items():
                if not isinstance(path, str) or not isinstance(text, str):
                    raise ValueError(f"{where}: snapshot entries must be {{relative path: file text}} strings, got "
                                     f"{path!r}: {type(text).__name__}")
                if path.startswith("/") or ".." in Path(path).parts:
                    raise ValueError(f"{where}: snapshot path {path!r} must be relative and stay inside the repository")
        elif not isinstance(self.snapshot, str):
            raise ValueError(f"{where}: snapshot must be a repository folder, a .tar/.tar.gz file or a "
                             f"{{path: text}} mapping, got {type(self.snapshot).__name__} {self.snapshot!r}")
        elif not (Path(self.snapshot).is_dir() or Path(self.snapshot).is_file()):
            raise ValueError(f"{where}: snapshot {self.snapshot!r} is neither a folder nor a tarball; give a "
                             "repository folder, a .tar/.tar.gz file, or a {path: text} mapping")
        else:
            check_snapshot_root(self.snapshot, where)

    @classmethod
    def from_row(cls, row: dict) -> "SweTask":
        """A task from a JSONL row (SWE-bench's key names: FAIL_TO_PASS, PASS_TO_PASS, patch, test_patch)."""
        missing = [key for key in ("instance_id", "problem_statement", "snapshot", "test_command", "FAIL_TO_PASS")
                   if key not in row]
        if missing:
            raise ValueError(f"SWE task row {row.get('instance_id', '?')!r} lacks {', '.join(missing)} "
                             "(docs/agents.md, 'SWE tasks', lists the row format)")
        known = {"instance_id", "problem_statement", "snapshot", "test_command", "FAIL_TO_PASS", "PASS_TO_PASS",
                 "test_patch", "log_format", "patch"}
        return cls(instance_id=row["instance_id"], problem_statement=row["problem_statement"], snapshot=row["snapshot"],
                   test_command=row["test_command"], fail_to_pass=_test_list(row, "FAIL_TO_PASS"),
                   pass_to_pass=_test_list(row, "PASS_TO_PASS"), test_patch=row.get("test_patch"),
                   log_format=row.get("log_format", "unittest"), reference_patch=row.get("patch"),
                   metadata={k: v for k, v in row.items() if k not in known})

    def to_row(self) -> dict:
        return {"instance_id": self.instance_id, "problem_statement": self.problem_statement,
                "snapshot": self.snapshot, "test_command": self.test_command,
                "FAIL_TO_PASS": list(self.fail_to_pass), "PASS_TO_PASS": list(self.pass_to_pass),
                "test_patch": self.test_patch, "log_format": self.log_format, "patch": self.reference_patch,
                **self.metadata}

    def original_file(self, path: str) -> Optional[str]:
        """The snapshot's text of `path` (relative), or None when the snapshot has no such file."""
        if isinstance(self.snapshot, dict):
            return self.snapshot.get(path)
        root = Path(self.snapshot)
        if root.is_dir():
            file = root / path
            return file.read_text(encoding="utf-8") if file.is_file() else None
        with tarfile.open(root, mode="r:*") as archive:
            for member in archive.getmembers():
                if member.isfile() and posixpath.normpath(member.name) == posixpath.normpath(path):
                    return archive.extractfile(member).read().decode("utf-8")
        return None
