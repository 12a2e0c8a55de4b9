"""The agent demo's task: add two two-digit numbers by calling the `add` tool, then answer.

    rows = episode_rows(addition_pairs(seed=0, count=512))       # prompt rows naming the environment
    sft = transcript_rows(pairs, tokenizer)                      # correct tool-call transcripts, two SFT rows each

An episode: the user asks "what is 12+34? use add"; the model replies with a tool call in the
tokenizer's format (`<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>` for the
Qwen-style template), reads the result, and answers with the number alone. Reward 1.0 when the
answer is exactly the sum and `add` was called with the task's numbers before it, else 0.0; the
episode ends at the first reply without a tool call.

A tiny model cannot add, but it can learn to copy: the numbers from the question into the call,
and the tool's result into the answer. Held-out prompts are number pairs the training rows do
not contain (`addition_pairs(..., exclude=...)`).
"""

from __future__ import annotations

import json
import random
from typing import Iterable, Sequence

from stacx.rollout.agents.environments import Environment, StepResult, register_environment
from stacx.rollout.agents.tools import ToolResult, register_tool
from stacx.wire.tool_calls import ToolCall

ENVIRONMENT_NAME = "tool_addition"
ENVIRONMENT_PATH = "stacx.tasks.tool_addition:ToolAdditionEnvironment"
"""What prompt rows name: 'module:Class' resolves wherever the rows are read, without a prior import."""
MAX_TURNS = 3
"""The call, the answer, and one more reply (a second call after an error, say)."""


@register_tool(timeout_s=2.0)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@register_environment(ENVIRONMENT_NAME, task_schema={
    "type": "object", "required": ["a", "b"],
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
class ToolAdditionEnvironment(Environment):
    """task['a'] + task['b'] with the `add` tool; reward 1.0 for the exact sum after a correct call."""

    tools = ("add",)

    def reset(self, task: dict, rng: random.Random) -> str:
        self.a, self.b = int(task["a"]), int(task["b"])
        self.called_with_task_numbers = False
        return question(self.a, self.b)

    def call_tool(self, call: ToolCall) -> ToolResult:
        result = super().call_tool(call)
        given = (call.arguments.get("a"), call.arguments.get("b"))
        if call.name == "add" and result.error is None and given in ((self.a, self.b), (self.b, self.a)):
            self.called_with_task_numbers = True
        return result

    def step(self, action: str) -> StepResult:
        expected = str(self.a + self.b)
        correct = self.called_with_task_numbers and action.strip() == expected
        return StepResult("", 1.0 if correct else 0.0, True,
                          info={"expected": expected, "used_tool": self.called_with_task_numbers})


def question(a: int, b: int) -> str:
    return f"what is {a}+{b}? use add"


def addition_pairs(*, seed: int, count: int, exclude: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """`count` distinct (a, b) pairs of two-digit numbers (10..99), none of them in `exclude`."""
    excluded = set(exclude)
    if count > 90 * 90 - len(excluded):
        raise ValueError(f"addition_pairs: only {90 * 90 - len(excluded)} pairs are left, {count} were asked for")
    rng, pairs, seen = random.Random(seed), [], set(excluded)
    while len(pairs) < count:
        pair = (rng.randint(10, 99), rng.randint(10, 99))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def episode_rows(pairs: Sequence[tuple[int, int]]) -> list[dict]:
    """Prompt rows that play the environment (the row's `prompt` is unused: `reset` writes the question)."""
    return [{"prompt": question(a, b), "label": str(a + b),
             "metadata": {"environment": ENVIRONMENT_PATH, "max_turns": MAX_TURNS, "a": a, "b": b}} for a, b in pairs]


def tool_call_text(a: int, b: int) -> str:
    """The reply that calls the tool, in the Qwen-style (hermes) format, compact JSON."""
    return "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, separators=(",", ":")) + "</tool_call>"


def transcript_rows(pairs: Sequence[tuple[int, int]], tokenizer) -> list[dict]:
    """Correct episodes as SFT rows {"prompt", "response"} over the rendered text, two per pair: the
    first messages -> the tool call, then everything through the tool's answer -> the sum.

    The text is what the episode runner's token ids decode to (the same `AgentSession`, the tool
    really runs), and it tokenizes back to those ids (checked), so SFT trains the very tokens the
    episodes will generate; read it with `apply_chat_template: false`."""
    from stacx.rollout.agents.episode import AgentSession

    eos = tokenizer.eos_token_id
    rows = []
    for a, b in pairs:
        session = AgentSession(ToolAdditionEnvironment(), {"a": a, "b": b}, tokenizer=tokenizer, rng=random.Random(0))
        call_ids = tokenizer(tool_call_text(a, b), add_special_tokens=False)["input_ids"] + [eos]
        observation = session.respond(call_ids).observation_ids
        first = list(session.prompt_ids)
        second = first + call_ids + list(observation)
        for prompt_ids, response in ((first, tool_call_text(a, b)), (second, str(a + b))):
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
            if tokenizer(prompt, add_special_tokens=False)["input_ids"] != prompt_ids:
                raise ValueError("transcript_rows: the tokenizer does not give the episode's ids back from their text; "
                                 "use a character tokenizer from stacx.rollout.agents.chat_tokenizers")
            rows.append({"prompt": prompt, "response": response})
    return rows
