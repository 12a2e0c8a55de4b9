"""A complete custom agent environment: count a letter in a word, with a tool to do it.

    stacx train --algorithm grpo --custom-module examples/agent_environment/letter_count.py \
        --prompt-data letter_rows.jsonl --hf-checkpoint CKPT ...

Each prompt row names the environment and its task fields (the row's `prompt` is not used: the
environment's `reset` writes the first messages):

    {"prompt": "count", "metadata": {"environment": "letter_count", "max_turns": 3, "word": "banana", "letter": "a"}}

The model may call `count_letter` (the chat template renders its schema; the episode runner parses
the call in the tokenizer's format and answers with the result). A reply without a tool call is an
answer: 1.0 if it holds the right count, 0.1 for a wrong number, and a reminder (no reward) when it
holds no number, until `max_turns` runs out. docs/agents.md walks through it.
"""

from __future__ import annotations

import re

from stacx import Environment, StepResult, register_environment, register_tool


@register_tool(timeout_s=2.0)
def count_letter(word: str, letter: str) -> int:
    """Count how many times a letter occurs in a word."""
    if len(letter) != 1:
        raise ValueError(f"letter must be one character, got {letter!r}")
    return word.count(letter)


@register_environment("letter_count", task_schema={
    "type": "object", "required": ["word", "letter"],
    "properties": {"word": {"type": "string"}, "letter": {"type": "string"}}})
class LetterCountEnvironment(Environment):
    tools = ("count_letter",)

    def reset(self, task, rng):
        self.expected = task["word"].count(task["letter"])
        return [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"How many times does {task['letter']!r} occur in {task['word']!r}?"}]

    def step(self, action):
        numbers = re.findall(r"\d+", action)
        if not numbers:
            return StepResult("Reply with the count as a number.", 0.0, False)
        correct = int(numbers[-1]) == self.expected
        return StepResult("", 1.0 if correct else 0.1, True, info={"expected": self.expected})
