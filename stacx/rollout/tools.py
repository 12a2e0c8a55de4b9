"""Tools a model may call during an episode: a registry with JSON schemas, and contained execution.

    @register_tool
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    @register_tool(name="search", parameters={"type": "object", "properties": {...}, "required": [...]},
                   timeout_s=5.0)
    def search(query: str) -> str: ...

The schema (OpenAI function format, what `tokenizer.apply_chat_template(messages, tools=...)`
renders) comes from `parameters` or, when omitted, from the signature: `str`, `int`, `float`,
`bool`, `list` and `dict` annotations become JSON types, parameters without a default are
required; the description is the docstring's first line. Tools are found like every other plugin:
a `--custom-module` file, a module in `stacx/custom/`, shipped to every Ray worker
(`stacx.plugins.discovery`).

`run_tool_call` never raises on a tool's behaviour: a tool that raises, does not return within its
timeout, returns something that is not a string or JSON, or is called with arguments its schema
refuses gives a `ToolResult` whose `error` says so (the model sees it as the tool's answer).
A tool that hangs keeps its daemon thread; the episode moves on.
"""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from stacx.plugins.registry import Registry
from stacx.rollout.tool_calls import ToolCall

DEFAULT_TOOL_TIMEOUT_S = 10.0
MAX_TOOL_OUTPUT_CHARS = 4_000
"""A longer answer is cut to this many characters (with a note): a runaway tool must not fill the context."""
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_PYTHON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
                 "object": (dict,)}

TOOLS = Registry("tool", user_may_replace_builtins=True)


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """What the model is told about a tool, and how long it may run."""

    name: str
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments object."""
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    """A call that has not returned after this many seconds answers with a timeout error."""

    def schema(self) -> dict:
        """The OpenAI-style entry of `tools=` in `apply_chat_template`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _schema_from_signature(fn: Callable) -> dict:
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = parameter.annotation
        if isinstance(annotation, str):  # `from __future__ import annotations` leaves names
            annotation = {t.__name__: t for t in _JSON_TYPES}.get(annotation, annotation)
        properties[name] = {"type": _JSON_TYPES[annotation]} if annotation in _JSON_TYPES else {}
        if parameter.default is parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def register_tool(fn: Optional[Callable] = None, *, name: Optional[str] = None, description: Optional[str] = None,
                  parameters: Optional[dict] = None, timeout_s: float = DEFAULT_TOOL_TIMEOUT_S):
    """Register `fn` as a tool (bare `@register_tool` or with arguments); returns `fn` with `fn.tool_spec`."""

    def decorator(function: Callable) -> Callable:
        if timeout_s <= 0:
            raise ValueError(f"register_tool {function.__name__!r}: timeout_s must be > 0, got {timeout_s}")
        schema = parameters if parameters is not None else _schema_from_signature(function)
        if schema.get("type") != "object":
            raise ValueError(f"register_tool {function.__name__!r}: parameters must be a JSON schema of "
                             f"type 'object', got {schema!r}")
        doc = (inspect.getdoc(function) or "").strip().splitlines()
        function.tool_spec = ToolSpec(name=name or function.__name__, description=description or (doc[0] if doc else ""),
                                      parameters=schema, timeout_s=float(timeout_s))
        return TOOLS.register(function.tool_spec.name)(function)

    return decorator(fn) if fn is not None else decorator


def get_tool(name: str) -> Callable:
    """The registered tool `name` (ValueError listing the registered names otherwise)."""
    return TOOLS.get(name)


@dataclass(frozen=True)
class ToolResult:
    """One call's answer: `content` is what the model sees (the output, or the error message)."""

    call: ToolCall
    content: str
    error: Optional[str] = None
    """None on success; else 'raised', 'timeout', 'bad_output', 'bad_arguments' or 'unknown_tool'."""


def argument_errors(schema: dict, arguments: dict, *, noun: str = "argument") -> list[str]:
    """What the arguments object breaks of its schema: required keys, unknown keys when
    `additionalProperties` is false, and the JSON type of each top-level property (`noun` names a key
    in the messages: 'argument', or 'field' for an environment's task)."""
    properties = schema.get("properties", {})
    errors = [f"missing required {noun} {key!r}" for key in schema.get("required", []) if key not in arguments]
    if schema.get("additionalProperties") is False:
        errors += [f"unknown {noun} {key!r} (known: {sorted(properties)})" for key in arguments if key not in properties]
    for key, value in arguments.items():
        expected = properties.get(key, {}).get("type")
        allowed = _PYTHON_TYPES.get(expected) if isinstance(expected, str) else None
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            errors.append(f"{noun} {key!r} must be of type {expected}, got {type(value).__name__}")
    return errors


def _as_text(value: Any) -> str:
    """The model-visible text of a tool's return value; TypeError for anything that is not str or JSON."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)
    if len(text) > MAX_TOOL_OUTPUT_CHARS:
        text = text[:MAX_TOOL_OUTPUT_CHARS] + f"... [cut: {len(text)} characters in all]"
    return text


def run_tool_call(call: ToolCall, function: Optional[Callable], spec: Optional[ToolSpec]) -> ToolResult:
    """Run `function(**call.arguments)` in a daemon thread bounded by `spec.timeout_s`; never raises."""
    if function is None or spec is None:
        return ToolResult(call, f"error: unknown tool {call.name!r}", "unknown_tool")
    problems = argument_errors(spec.parameters, call.arguments)
    if problems:
        return ToolResult(call, f"error: bad arguments for {spec.name}: {'; '.join(problems)}", "bad_arguments")
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = function(**call.arguments)
        except BaseException as error:  # noqa: BLE001 - a tool's failure is an observation, not a crash
            box["error"] = error

    worker = threading.Thread(target=target, name=f"tool-{spec.name}", daemon=True)
    worker.start()
    worker.join(spec.timeout_s)
    if worker.is_alive():
        return ToolResult(call, f"error: {spec.name} did not answer within {spec.timeout_s:g} s", "timeout")
    if "error" in box:
        error = box["error"]
        return ToolResult(call, f"error: {spec.name} raised {type(error).__name__}: {error}", "raised")
    try:
        return ToolResult(call, _as_text(box.get("value")))
    except (TypeError, ValueError) as error:
        return ToolResult(call, f"error: {spec.name} returned {type(box.get('value')).__name__}, which is neither "
                                f"text nor JSON ({error})", "bad_output")
