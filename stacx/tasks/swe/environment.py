"""The `swe` environment: an agent fixes an SWE task through tools in a sandboxed working copy.

    {"prompt": "swe", "label": "seriescalc__sum_up_to",
     "metadata": {"environment": "swe", "max_turns": 20, "swe_builtin": "seriescalc__sum_up_to",
                  "sandbox": {"backend": "namespace"}}}        (or "swe_task": a task row, docs/agents.md)

`reset` opens a sandbox session on the task's snapshot and shows the issue; the model then calls
`bash(command)`, `read_file(path)`, `write_file(path, content)` (all in the working copy) and
`submit()`. `submit` ends the episode: the files the agent changed are read from its session and the
task's tests run on them in a fresh copy of the snapshot, with every test file restored
(`evaluate_session`, stacx/tasks/swe/evaluate.py); the reward is 1.0 when the task is resolved, else
0.0 (or, with `partial_credit: true` in the task, the fraction of its listed tests that passed). An episode that reaches `max_turns` without
`submit` earns 0.0. The session is closed when the episode ends, however it ends.

The module registers `swe` when imported: `--custom-module stacx.tasks.swe.environment`
(the launchers in scripts/train/swe/ pass it).
"""

from __future__ import annotations

import random
import weakref
from typing import Callable, Optional

from stacx.rollout.agents.environments import Environment, Messages, StepResult, register_environment
from stacx.rollout.agents.tools import MAX_TOOL_OUTPUT_CHARS, ToolResult, ToolSpec, argument_errors
from stacx.rollout.episode_retry import infrastructure_cause
from stacx.sandbox import RunResult, SandboxConfig, SandboxLimits, SandboxSession
from stacx.tasks.swe.evaluate import SweEvaluation, evaluate_session, snapshot_source
from stacx.tasks.swe.reward import sandbox_for, task_of
from stacx.wire.tool_calls import ToolCall

_HEAD_CHARS = MAX_TOOL_OUTPUT_CHARS // 4
"""A cut output keeps its first quarter and its end (the end of a log says what failed)."""


def _tool(name: str, description: str, properties: dict, timeout_s: float) -> ToolSpec:
    return ToolSpec(name=name, description=description, timeout_s=timeout_s,
                    parameters={"type": "object", "properties": properties, "required": sorted(properties),
                                "additionalProperties": False})


def swe_tool_specs(command_limits: SandboxLimits) -> dict[str, ToolSpec]:
    """The four tools; a call's timeout is its sandboxed command's wall time (the sandbox enforces it)."""
    wall = float(command_limits.wall_time_s)
    return {spec.name: spec for spec in (
        _tool("bash", "Run a shell command in the repository's root (no network); returns its exit code and output.",
              {"command": {"type": "string"}}, wall),
        _tool("read_file", "Read a text file of the repository (path relative to its root).",
              {"path": {"type": "string"}}, wall),
        _tool("write_file", "Replace a file of the repository with `content` (created if missing).",
              {"path": {"type": "string"}, "content": {"type": "string"}}, wall),
        _tool("submit", "Submit your changes: the repository's tests are run and the episode ends.", {}, wall),
    )}


def clip(text: str) -> str:
    """`text` cut to MAX_TOOL_OUTPUT_CHARS around a note (head and tail kept)."""
    if len(text) <= MAX_TOOL_OUTPUT_CHARS:
        return text
    tail = MAX_TOOL_OUTPUT_CHARS - _HEAD_CHARS
    return f"{text[:_HEAD_CHARS]}\n... [{len(text) - MAX_TOOL_OUTPUT_CHARS} characters cut] ...\n{text[-tail:]}"


def _describe(result: RunResult) -> str:
    status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
    parts = [status]
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    return clip("\n".join(parts))


def first_messages(problem_statement: str) -> Messages:
    system = ("You are fixing an issue in a Python repository. The repository is your working directory. Use the "
              "tools: bash(command) runs a shell command there, read_file(path) and write_file(path, content) read "
              "and replace files. Run the tests to check your fix, then call submit() once; it runs the hidden tests "
              "and ends the episode.")
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Issue:\n{problem_statement}"}]


@register_environment("swe", task_schema={
    "type": "object",
    "properties": {"swe_task": {"type": "object"}, "swe_builtin": {"type": "string"}, "sandbox": {"type": "object"},
                   "partial_credit": {"type": "boolean"}}})
class SweEnvironment(Environment):
    """One SWE task in one sandbox session (see the module doc)."""

    _closer: Optional[weakref.finalize] = None
    """Closes the session (set by `reset`; None before it, when `close` has nothing to close)."""

    def reset(self, task: dict, rng: random.Random) -> Messages:
        self.task = task_of(task)
        self.partial_credit = bool(task.get("partial_credit", False))
        setting = task.get("sandbox") or {}
        try:
            self.command_limits = SandboxConfig.from_dict(setting).limits
        except (TypeError, ValueError) as error:
            raise ValueError(f"SWE task {self.task.instance_id!r}: metadata 'sandbox': {error}") from None
        self.specs = swe_tool_specs(self.command_limits)
        self.sandbox = sandbox_for(setting)
        self.session: SandboxSession = self.sandbox.create(snapshot_source(self.task))
        # A session must not outlive its episode even if the runner never reaches `close`.
        self._closer = weakref.finalize(self, self.session.close)
        self.evaluation: Optional[SweEvaluation] = None
        self.submitted = False
        return first_messages(self.task.problem_statement)

    def tool_specs(self) -> list[ToolSpec]:
        return [self.specs[name] for name in self.tools]

    def call_tool(self, call: ToolCall) -> ToolResult:
        """Run one call in the session; a timeout or a failed command is an error observation. A sandbox server
        that does not answer, fails or lost the session is raised: it is not the policy's doing, and the
        episode is played again (stacx.rollout.episode_retry)."""
        spec = self.specs.get(call.name)
        if spec is None:
            return ToolResult(call, f"error: unknown tool {call.name!r}; available: {list(self.tools)}", "unknown_tool")
        problems = argument_errors(spec.parameters, call.arguments)
        if problems:
            return ToolResult(call, f"error: bad arguments for {spec.name}: {'; '.join(problems)}", "bad_arguments")
        if self.submitted:
            return ToolResult(call, "error: already submitted", "raised")
        run = self.TOOL_METHODS[call.name]
        try:
            return run(self, call, **call.arguments)
        except Exception as error:  # noqa: BLE001 - a broken sandbox is the agent's observation, counted
            if infrastructure_cause(error) is not None:
                raise
            return ToolResult(call, f"error: the sandbox failed: {type(error).__name__}: {error}", "raised")

    def _bash(self, call: ToolCall, command: str) -> ToolResult:
        result = self.session.run(command, self.command_limits)
        return ToolResult(call, _describe(result), "timeout" if result.timed_out else None)

    def _read_file(self, call: ToolCall, path: str) -> ToolResult:
        result = self.session.run(["cat", "--", path], self.command_limits)
        if result.ok:
            return ToolResult(call, clip(result.stdout))
        return ToolResult(call, _describe(result), "timeout" if result.timed_out else None)

    def _write_file(self, call: ToolCall, path: str, content: str) -> ToolResult:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = self.session.run(["sh", "-c", script, "write_file", path], self.command_limits,
                                  stdin=content.encode("utf-8"))
        if result.ok:
            return ToolResult(call, f"wrote {len(content)} characters to {path}")
        return ToolResult(call, _describe(result), "timeout" if result.timed_out else None)

    def _submit(self, call: ToolCall) -> ToolResult:
        self.submitted = True
        self.evaluation = evaluate_session(self.task, self.session, self.sandbox)
        return ToolResult(call, "submitted")

    TOOL_METHODS: dict[str, Callable[..., ToolResult]] = {
        "bash": _bash, "read_file": _read_file, "write_file": _write_file, "submit": _submit}
    """Tool name -> the method running its call (`swe_tool_specs` describes the same four)."""
    tools = tuple(TOOL_METHODS)

    def step(self, action: str) -> StepResult:
        return StepResult("No tool was called. Use the tools to fix the issue, then call submit().", 0.0, False)

    def episode_end(self) -> Optional[StepResult]:
        if not self.submitted:
            return None
        evaluation = self.evaluation
        info = {"instance_id": self.task.instance_id, "submitted": True}
        if evaluation is None:  # the test run itself failed (the submit call's error says why)
            return StepResult("", 0.0, True, info={**info, "resolved": False})
        reward = evaluation.reward
        if self.partial_credit and not evaluation.resolved and evaluation.error is None:
            statuses = list(evaluation.test_statuses.values())
            reward = sum(status == "passed" for status in statuses) / max(1, len(statuses))
        info.update(resolved=evaluation.resolved, tests=evaluation.test_statuses, error=evaluation.error,
                    dropped=list(evaluation.dropped))
        return StepResult("", reward, True, info=info)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
