"""Tool and environment registries (schemas, discovery from a --custom-module file, bad input named),
and tool failures contained: a tool that raises, hangs or returns garbage is an observation, counted."""

from __future__ import annotations

import random
import textwrap
import threading

import pytest

from stacx.plugins.discovery import load_custom_modules
from stacx.rollout.agents.environments import (ENVIRONMENTS, CalculatorEnvironment, Environment, StepResult, check_task,
                                        resolve_environment)
from stacx.rollout.agents.tools import TOOLS, argument_errors, get_tool, register_tool, run_tool_call
from stacx.wire.tool_calls import ToolCall


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, call_id="call_test_0")


@pytest.fixture
def scratch_tools():
    """Registers tools for one test and removes them after it."""
    names = []

    def add(fn=None, **kwargs):
        registered = register_tool(fn, **kwargs) if fn is not None else None
        names.append(registered.tool_spec.name)
        return registered

    yield add
    for name in names:
        TOOLS.unregister(name)


def test_schema_comes_from_the_signature_and_docstring(scratch_tools):
    def scale_list(values: list, factor: float = 2.0, label: str = "x") -> list:
        """Multiply every value by factor.

        More text that is not the description."""
        return [v * factor for v in values]

    scratch_tools(scale_list)
    spec = get_tool("scale_list").tool_spec
    assert spec.schema() == {"type": "function", "function": {
        "name": "scale_list", "description": "Multiply every value by factor.",
        "parameters": {"type": "object", "required": ["values"], "properties": {
            "values": {"type": "array"}, "factor": {"type": "number"}, "label": {"type": "string"}}}}}
    assert argument_errors(spec.parameters, {"factor": "2", "values": [1]}) == [
        "argument 'factor' must be of type number, got str"]
    assert run_tool_call(_call("scale_list", values=[1, 2]), scale_list, spec).content == "[2.0, 4.0]"
    with pytest.raises(ValueError, match="already registered"):
        register_tool(scale_list)


def test_failing_tools_become_error_observations(scratch_tools):
    def explode() -> str:
        raise RuntimeError("disk on fire")

    release = threading.Event()  # set at the end, so the abandoned call's thread ends with the test

    def sleepy() -> str:
        release.wait(30)
        return "late"

    def garbage():
        return object()

    def chatty() -> str:
        return "y" * 10_000

    for fn in (explode, garbage, chatty):
        scratch_tools(fn)
    scratch_tools(sleepy, timeout_s=0.2)
    try:
        results = {fn.__name__: run_tool_call(_call(fn.__name__), fn, fn.tool_spec)
                   for fn in (explode, sleepy, garbage, chatty)}
    finally:
        release.set()
    assert results["explode"].error == "raised" and "RuntimeError: disk on fire" in results["explode"].content
    assert results["sleepy"].error == "timeout" and "0.2 s" in results["sleepy"].content
    assert results["garbage"].error == "bad_output" and "neither text nor JSON" in results["garbage"].content
    assert results["chatty"].error is None and results["chatty"].content.endswith("[cut: 10000 characters in all]")
    unexpected = run_tool_call(_call("explode", extra=1), explode, explode.tool_spec)
    assert unexpected.error == "raised" and "unexpected keyword argument 'extra'" in unexpected.content
    assert run_tool_call(_call("nope"), None, None).error == "unknown_tool"


def test_calculator_environment_offers_its_tool_and_refuses_unoffered_ones():
    env = CalculatorEnvironment()
    env.reset({"expression": "6/4"}, random.Random(0))
    assert [s.name for s in env.tool_specs()] == ["calculator"]
    assert env.call_tool(_call("calculator", expression="6/4")).content == "1.5"
    assert env.call_tool(_call("calculator", expression="__import__('os')")).error == "raised"
    assert env.call_tool(_call("calculator")).error == "bad_arguments"
    assert env.call_tool(_call("scale_list", values=[])).error == "unknown_tool"
    assert env.step("so it is 1.5").reward == 1.0 and env.step("1.4").reward == 0.0


def test_environment_from_a_custom_module_file_and_bad_names(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent('''
        from stacx.rollout.agents.environments import Environment, StepResult, register_environment

        @register_environment("echo_under_test", task_schema={"type": "object", "required": ["word"],
                                                             "properties": {"word": {"type": "string"}}})
        class Echo(Environment):
            def reset(self, task, rng):
                self.word = task["word"]
                return "say " + self.word
            def step(self, action):
                return StepResult("again", float(action == self.word), action == self.word)
    '''))
    try:
        load_custom_modules([str(path)])
        cls = resolve_environment("echo_under_test")
        assert issubclass(cls, Environment) and cls.task_schema["required"] == ["word"]
        check_task(cls, {"word": "hi", "label": None}, where="row 1")
        with pytest.raises(ValueError, match=r"row 3: .*missing required field 'word'"):
            check_task(cls, {"label": None}, where="row 3")
        with pytest.raises(ValueError, match=r"row 4: .*field 'word' must be of type string"):
            check_task(cls, {"word": 5}, where="row 4")
    finally:
        ENVIRONMENTS.unregister("echo_under_test")
    with pytest.raises(ValueError, match=r"row 2: unknown environment 'echo_undr_test'.*register_environment"):
        resolve_environment("echo_undr_test", where="row 2")
    with pytest.raises(ValueError, match="did you mean 'guess_number'"):
        resolve_environment("guess_numbr")
    with pytest.raises(ValueError, match="is not a stacx.rollout.agents.environments.Environment"):
        resolve_environment("stacx.rollout.agents.environments:StepResult")
    assert resolve_environment("stacx.rollout.agents.environments:CalculatorEnvironment") is CalculatorEnvironment
    assert isinstance(StepResult("x", 0.0, False).info, dict)
