"""Prompt rows for SWE tasks: the problem statement and the repository's files, the task in metadata."""

from __future__ import annotations

from typing import Iterable, Optional

from stacx.tasks.swe.row import SweTask


def swe_prompt(task: SweTask) -> str:
    """What a single-turn agent is asked: the issue, the files (for an in-memory snapshot), a diff as the answer."""
    parts = [f"Fix this issue in the repository.\n\nIssue:\n{task.problem_statement}\n"]
    if isinstance(task.snapshot, dict):
        for path, text in sorted(task.snapshot.items()):
            parts.append(f"File {path}:\n```\n{text}```\n")
    parts.append("Answer with a unified diff (paths a/... b/..., applied with `patch -p1`) in a ```diff block.")
    return "\n".join(parts)


def swe_prompt_rows(tasks: Iterable[SweTask], *, sandbox: Optional[dict] = None) -> list[dict]:
    """Rows for `--prompt-data` with `--reward-fn stacx.tasks.swe.reward:swe_tests_reward`."""
    rows = []
    for task in tasks:
        metadata = {"swe_task": task.to_row()}
        if sandbox is not None:
            metadata["sandbox"] = sandbox
        rows.append({"prompt": swe_prompt(task), "label": task.instance_id, "metadata": metadata})
    return rows
