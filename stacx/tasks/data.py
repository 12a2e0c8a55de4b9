"""`prompt_data: builtin:<task>`: built-in task datasets written as JSONL the data loader reads.

    path = resolve_data_path("builtin:sorting", out_dir="outputs/run")      # .../builtin/sorting/train.jsonl
    path = resolve_data_path("builtin:sorting/eval", out_dir="outputs/run") # held-out prompts
    path = resolve_data_path("data/train.jsonl", out_dir=...)               # anything else: unchanged

Every row carries all the keys the loader's kinds need, so one file serves RL prompts
(`prompt`, `label`), SFT (`prompt`, `response`) and DPO (`prompt`, `chosen`, `rejected`; the
rejected answer is the correct one with one character changed). The content depends only on
the task and a fixed data seed, so every rank and every process writes the same bytes; files
are written atomically and reused when present.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from stacx.tasks.builtin import BuiltinTask, get_task, sample_examples

BUILTIN_PREFIX = "builtin:"
SPLITS = ("train", "eval")
DEFAULT_NUM_TRAIN = 2048
DEFAULT_NUM_EVAL = 128
DATA_SEED = 0
"""Fixed: the dataset of a task is the same in every run (the run seed only orders it)."""


@dataclass(frozen=True)
class BuiltinDataSpec:
    task: BuiltinTask
    split: str


def is_builtin(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(BUILTIN_PREFIX)


def parse_builtin_spec(spec: str) -> BuiltinDataSpec:
    """'builtin:sorting' -> (sorting, train); 'builtin:sorting/eval' -> (sorting, eval)."""
    body = spec[len(BUILTIN_PREFIX):]
    name, _, split = body.partition("/")
    split = split or "train"
    if split not in SPLITS:
        raise ValueError(f"prompt data {spec!r}: split {split!r} is not one of {SPLITS}")
    try:
        task = get_task(name)
    except ValueError as err:
        raise ValueError(f"prompt data {spec!r}: {err}") from None
    return BuiltinDataSpec(task, split)


def _rejected_answer(answer: str, alphabet: str, rng: random.Random) -> str:
    """The answer with one character replaced by another character of the task's alphabet."""
    position = rng.randrange(len(answer))
    choices = [c for c in alphabet if c != answer[position] and c != "="]
    return answer[:position] + rng.choice(choices) + answer[position + 1:]


def task_rows(task: BuiltinTask, split: str, *, num_train: int = DEFAULT_NUM_TRAIN,
              num_eval: int = DEFAULT_NUM_EVAL) -> list[dict]:
    """The rows of one split; eval prompts never appear in train."""
    train = sample_examples(task, num_train, DATA_SEED)
    pairs = train if split == "train" else sample_examples(task, num_eval, DATA_SEED + 1,
                                                            exclude={prompt for prompt, _ in train})
    rng = random.Random(DATA_SEED + 2 + SPLITS.index(split))
    return [{"prompt": prompt, "label": answer, "response": answer, "chosen": answer,
             "rejected": _rejected_answer(answer, task.alphabet, rng), "metadata": {"task": task.name}}
            for prompt, answer in pairs]


def write_rows(rows: list[dict], path: str) -> str:
    """Write JSONL atomically (a temporary file renamed into place)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(temporary, path)
    return path


def resolve_data_path(spec: str | None, *, out_dir: str) -> str | None:
    """The file a `prompt_data` / `eval_data` value names: built-in tasks are written under
    `out_dir/builtin/<task>/<split>.jsonl` (once) and their path returned; other values unchanged."""
    if not is_builtin(spec):
        return spec
    parsed = parse_builtin_spec(spec)
    path = os.path.join(out_dir, "builtin", parsed.task.name, f"{parsed.split}.jsonl")
    if not os.path.isfile(path):
        write_rows(task_rows(parsed.task, parsed.split), path)
    return path


def resolve_builtin_data(run_config):
    """The run config with `prompt_data` / `eval_data` of the form `builtin:<task>` replaced by the
    JSONL files written for them under the run's output folder; other values unchanged."""
    import dataclasses

    rollout = run_config.rollout
    out_dir = run_config.logging.out
    resolved = dataclasses.replace(rollout, prompt_data=resolve_data_path(rollout.prompt_data, out_dir=out_dir),
                                   eval_data=resolve_data_path(rollout.eval_data, out_dir=out_dir))
    return dataclasses.replace(run_config, rollout=resolved)
