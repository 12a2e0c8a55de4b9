"""Multi-turn environments: the task side of an agent episode, registered by name.

    @register_environment("my_game", task_schema={"type": "object", "required": ["target"]})
    class MyGame(Environment):
        tools = ("calculator",)                       # registered tools offered to the model
        def reset(self, task, rng): return [{"role": "user", "content": "..."}]   # or a str
        def step(self, action): return StepResult("...", reward=0.0, done=False)

`reset(task, rng)` gives the first messages (a str is one user message); `step(action)` answers a
model reply that called no tool with the observation (a str is one user message, or a list of
messages), the turn's reward, whether the episode ended, and free-form `info`. Tool calls do not
reach `step`: the episode runner (`stacx.rollout.episode`) parses them and answers with
`call_tool`'s results (override it to bind tools to per-episode state, such as a sandbox).
After a turn's tool calls, `episode_end()` may end the episode (a `submit` tool); `close()` releases
the episode's resources once it is over, however it ended (the runner calls it).

A prompt row plays an environment by naming it in its metadata; the other metadata fields, plus
the row's `label`, are the task (checked against `task_schema` before the episode starts):

    {"prompt": "...", "label": "7", "metadata": {"environment": "calculator", "max_turns": 3, "expression": "3+4"}}

Environments are found like every other plugin (`--custom-module`, `stacx/custom/`), or by
'module:Class'.
"""

from __future__ import annotations

import abc
import ast
import importlib
import operator
import random
from dataclasses import dataclass, field
from typing import Optional, Union

from stacx.plugins.registry import Registry
from stacx.rollout.tool_calls import ToolCall
from stacx.rollout.tools import ToolResult, ToolSpec, argument_errors, get_tool, register_tool, run_tool_call

Messages = list[dict]
ENVIRONMENTS = Registry("environment", user_may_replace_builtins=True)


@dataclass
class StepResult:
    observation: Union[str, Messages]
    """The environment's answer: a str is one user message; or a list of chat messages."""
    reward: float
    """This turn's reward; the episode's reward is the sum over its turns."""
    done: bool
    info: dict = field(default_factory=dict)
    """Anything to keep with the trajectory (recorded per turn in the sample's metadata)."""


class Environment(abc.ABC):
    """One episode of a task; a fresh instance per episode."""

    tools: tuple[str, ...] = ()
    """Names of registered tools offered to the model (rendered by the chat template's `tools=`)."""
    tool_call_style: Optional[str] = None
    """'hermes' or 'llama3'; None reads it from the tokenizer's chat template."""
    task_schema: Optional[dict] = None
    """JSON schema of the task fields (set by `register_environment`); None checks nothing."""

    @abc.abstractmethod
    def reset(self, task: dict, rng: random.Random) -> Union[str, Messages]:
        """Start an episode for `task`; return the first messages (a str is one user message)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Answer a model reply that called no tool (its text without the end-of-turn token)."""

    def tool_specs(self) -> list[ToolSpec]:
        """The offered tools' specs, in `tools` order (ValueError naming an unregistered one)."""
        return [get_tool(name).tool_spec for name in self.tools]

    def call_tool(self, call: ToolCall) -> ToolResult:
        """Run one call of an offered, registered tool (contained: never raises; see `run_tool_call`)."""
        if call.name not in self.tools:
            return ToolResult(call, f"error: unknown tool {call.name!r}; available: {list(self.tools)}", "unknown_tool")
        function = get_tool(call.name)
        return run_tool_call(call, function, function.tool_spec)

    def episode_end(self) -> Optional[StepResult]:
        """Asked after a turn's tool calls ran: a StepResult ends the episode there, with its reward and
        info (e.g. a `submit` tool was called); None (the default) lets the model reply again."""
        return None

    def close(self) -> None:
        """Release the episode's resources (a sandbox session). The runner calls it once the episode is
        over: ended, at the turn limit, or when the rollout failed. The default does nothing."""


def register_environment(name: str, *, task_schema: Optional[dict] = None):
    """Class decorator: register an `Environment` subclass under `name`, with the JSON schema of its task."""

    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"register_environment({name!r}): {cls!r} is not a stacx.rollout.environments.Environment")
        if task_schema is not None:
            cls.task_schema = task_schema
        return ENVIRONMENTS.register(name)(cls)

    return decorator


def resolve_environment(name: str, *, where: str = "metadata") -> type:
    """The Environment class registered as `name`, or named by 'module:Class'."""
    if ":" not in name:
        try:
            return ENVIRONMENTS.get(name)
        except ValueError as error:
            raise ValueError(f"{where}: {error} (register one with @register_environment, or name it "
                             "'module:Class')") from None
    module_name, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}: environment {name!r}: cannot import it ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{where}: environment {name!r} is not a stacx.rollout.environments.Environment")
    return cls


def check_task(cls: type, task: dict, *, where: str) -> None:
    """ValueError naming the row and the fields when `task` breaks the environment's `task_schema`."""
    problems = argument_errors(cls.task_schema, task, noun="field") if cls.task_schema else []
    if problems:
        raise ValueError(f"{where}: task of environment {cls.__name__}: {'; '.join(problems)} (task fields are the "
                         "row's metadata besides 'environment', 'max_turns' and 'tool_call_style', plus 'label')")


# ---- built-in toy environments ------------------------------------------------------------------

@register_environment("guess_number")
class GuessNumberEnvironment(Environment):
    """Guess a hidden digit 0-9; after each guess the environment says higher, lower or correct.

    Reward 1.0 on the turn the guess is correct (the episode ends), 0.0 otherwise. task['target']
    fixes the digit; without it the digit is drawn from rng.
    """

    def reset(self, task: dict, rng: random.Random) -> str:
        self.target = int(task["target"]) if task.get("target") is not None else rng.randint(0, 9)
        return "guess a digit"

    def step(self, action: str) -> StepResult:
        digits = [c for c in action if c.isdigit()]
        if not digits:
            return StepResult("say a digit", 0.0, False)
        guess = int(digits[0])
        if guess == self.target:
            return StepResult("correct", 1.0, True)
        return StepResult("higher" if guess < self.target else "lower", 0.0, False)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> float:
    """+ - * / and parentheses over numbers, without `eval` (ValueError for anything else)."""

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")

    return walk(ast.parse(expression, mode="eval").body)


@register_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / and parentheses)."""
    value = evaluate_arithmetic(expression)
    return f"{value:g}"


@register_environment("calculator", task_schema={"type": "object", "required": ["expression"],
                                                 "properties": {"expression": {"type": "string"}}})
class CalculatorEnvironment(Environment):
    """Compute task['expression'] with the `calculator` tool; reward 1.0 when the final answer (a
    reply without a tool call) contains the value, and the episode ends with that answer."""

    tools = ("calculator",)

    def reset(self, task: dict, rng: random.Random) -> Messages:
        self.expected = f"{evaluate_arithmetic(task['expression']):g}"
        return [{"role": "user", "content": f"what is {task['expression']}? use the calculator"}]

    def step(self, action: str) -> StepResult:
        correct = self.expected in action
        return StepResult("", 1.0 if correct else 0.0, True, info={"expected": self.expected})
