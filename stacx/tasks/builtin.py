"""Built-in tasks: small synthetic problems with exact answers, for the demo and CI runs.

A task turns a seeded random generator into (prompt, answer) pairs over a tiny alphabet, so a
character tokenizer of about 20 symbols covers it and a 2-layer model learns it in minutes:

    task = get_task("addition")
    prompt, answer = task.sample(random.Random(0))    # ("47+8=", "55")
    task.reward(" 55", "55")                            # 1.0 (exact match after strip)

Prompts end with '=' and answers are what follows it, so no chat template is needed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from stacx.plugins.registry import Registry


@dataclass(frozen=True)
class BuiltinTask:
    name: str
    """Name used in `prompt_data: builtin:<name>`."""
    description: str
    """One line shown by the demo and in errors."""
    alphabet: str
    """Every character a prompt or answer can contain (the character tokenizer's vocabulary)."""
    generate: Callable[[random.Random], tuple[str, str]]
    """rng -> (prompt, answer)."""
    max_answer_chars: int
    """Longest answer, so rollouts can stop at max_answer_chars + 1 tokens (answer + <eos>)."""

    def sample(self, rng: random.Random) -> tuple[str, str]:
        return self.generate(rng)

    def reward(self, response: str, label, metadata: dict | None = None) -> float:
        """1.0 when the response is exactly the answer (surrounding spaces ignored), else 0.0."""
        return float(str(response).strip() == str(label).strip())


def _addition(rng: random.Random) -> tuple[str, str]:
    """a+b= with a in [0, 99], b in [0, 9]: one carry at most, answers up to 108."""
    a, b = rng.randrange(100), rng.randrange(10)
    return f"{a}+{b}=", str(a + b)


def _two_digit_addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a}+{b}=", str(a + b)


def _sorting(rng: random.Random) -> tuple[str, str]:
    """Five digits in random order -> the same digits sorted."""
    digits = [str(rng.randrange(10)) for _ in range(5)]
    return "".join(digits) + "=", "".join(sorted(digits))


def _reversal(rng: random.Random) -> tuple[str, str]:
    """A 3 to 6 letter word over a-h -> the word reversed."""
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
    return word + "=", word[::-1]


TASKS: Registry[BuiltinTask] = Registry("built-in task", entries_are_callable=False, ships_user_modules=False,
                                      discovers=False, known_as="known tasks")
"""Name -> built-in task (a `stacx.plugins.registry.Registry`: a name registered twice is refused)."""


def register_task(task: BuiltinTask) -> BuiltinTask:
    return TASKS.add(task.name, task, origin=task.generate)


register_task(BuiltinTask("addition", "a+b= with a two-digit a and a one-digit b (the demo's task)",
                          "0123456789+=", _addition, max_answer_chars=3))
register_task(BuiltinTask("two_digit_addition", "a+b= with two-digit a and b", "0123456789+=",
                          _two_digit_addition, max_answer_chars=3))
register_task(BuiltinTask("sorting", "sort five digits ascending", "0123456789=", _sorting, max_answer_chars=5))
register_task(BuiltinTask("reversal", "reverse a 3-6 letter word over a-h", "abcdefgh=", _reversal,
                          max_answer_chars=6))


def get_task(name: str) -> BuiltinTask:
    """The built-in task `name`; ValueError listing the known ones otherwise."""
    return TASKS.get(name)


def sample_examples(task: BuiltinTask, num_examples: int, seed: int, *, exclude: set[str] | None = None) -> list[tuple[str, str]]:
    """`num_examples` (prompt, answer) pairs from `seed`, skipping prompts in `exclude` (held-out sets)."""
    rng = random.Random(seed)
    exclude = exclude or set()
    examples = []
    attempts = 0
    while len(examples) < num_examples:
        attempts += 1
        if attempts > 100 * num_examples + 1000:
            raise ValueError(f"task {task.name!r}: cannot draw {num_examples} prompts outside the excluded set")
        prompt, answer = task.sample(rng)
        if prompt not in exclude:
            examples.append((prompt, answer))
    return examples
