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


DEFAULT_MAX_TURNS = 20
"""Model replies per episode of the `swe` environment unless the rows say otherwise."""


def swe_environment_rows(tasks: Iterable[SweTask], *, max_turns: int = DEFAULT_MAX_TURNS,
                         sandbox: Optional[dict] = None, partial_credit: bool = False) -> list[dict]:
    """Rows for `--prompt-data` that play the `swe` environment (`stacx.tasks.swe.environment`): one episode
    per task, the task row and the sandbox setting in metadata; the prompt is the issue (the environment
    writes the first messages itself)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    rows = []
    for task in tasks:
        metadata = {"environment": "swe", "max_turns": max_turns, "swe_task": task.to_row()}
        if sandbox:
            metadata["sandbox"] = sandbox
        if partial_credit:
            metadata["partial_credit"] = True
        rows.append({"prompt": task.problem_statement, "label": task.instance_id, "metadata": metadata})
    return rows
