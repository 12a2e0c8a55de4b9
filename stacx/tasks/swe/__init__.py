"""SWE tasks: repository snapshots with a problem statement, tests that must go from failing to passing,
and the reward that runs them in a sandbox after the agent's edits (docs/agents.md, "SWE tasks")."""

from stacx.tasks.swe.builtin import FAMILIES, builtin_swe_tasks, get_swe_task
from stacx.tasks.swe.evaluate import (AgentEdits, SweEvaluation, evaluate_edits, evaluate_patch, evaluate_session,
                                      extract_patch, files_touched)
from stacx.tasks.swe.log_parsers import LOG_PARSERS
from stacx.tasks.swe.prompts import swe_environment_rows, swe_prompt_rows
from stacx.tasks.swe.row import SweTask

__all__ = ["FAMILIES", "builtin_swe_tasks", "get_swe_task", "AgentEdits", "SweEvaluation", "evaluate_edits",
           "evaluate_patch", "evaluate_session",
           "extract_patch", "files_touched", "LOG_PARSERS", "swe_environment_rows", "swe_prompt_rows", "SweTask"]
