"""Prompt, SFT and DPO datasets from JSONL or Parquet, with a checkpointable position.

    data = load_examples(DataConfig(path="train.jsonl", kind="prompt"), tokenizer)
    loader = EpochLoader(data, seed=0)
    batch = loader.next_batch(8)             # deterministic per-epoch shuffle
    state = loader.state_dict()              # saved with the checkpoint; load_state_dict resumes

Row formats (key names configurable; every field rule, with examples: docs/data.md):
  prompt  {"prompt": str | [messages], "label": ..., "metadata": {...}}
  sft     {"prompt": str, "response": str}  or  {"messages": [..., {"role": "assistant", ...}]}
  dpo     {"prompt": str | [messages], "chosen": str, "rejected": str}
JSONL is parsed line by line so a malformed row is reported with its file and line; Parquet
goes through `datasets` and is reported by row number. `malformed_rows="skip"` logs and skips.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import torch

from stacx.rollout.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

KINDS = ("prompt", "sft", "dpo")


class ExampleSource(Protocol):
    """Where a run's prompts come from, as the rollout reads them (the trainer's `StepDataSource`)."""

    batch_size: int
    """Prompts per rollout step (rollout_batch_size)."""

    def next_examples(self, count: Optional[int] = None) -> list:
        """The next `count` examples (default: one step's `batch_size`)."""


class MalformedRowError(ValueError):
    """A dataset row that cannot be used; the message names the file and line (or row)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str
    """A .jsonl / .json-lines or .parquet file."""
    kind: str = "prompt"
    """'prompt' (RL), 'sft' or 'dpo'."""
    input_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"
    response_key: str = "response"
    messages_key: str = "messages"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (plain text becomes one user message)."""
    malformed_rows: str = "fail"
    """'fail' raises MalformedRowError at the first bad row; 'skip' logs it and continues."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"data kind must be one of {KINDS}, got {self.kind!r}")
        if self.malformed_rows not in ("fail", "skip"):
            raise ValueError(f"malformed_rows must be 'fail' or 'skip', got {self.malformed_rows!r}")


@dataclass
class Example:
    """One usable row, tokenized. `response_ids`: SFT target; `chosen_ids`/`rejected_ids`: DPO pair."""

    prompt_ids: list[int]
    source: str
    label: Any = None
    metadata: dict = field(default_factory=dict)
    response_ids: Optional[list[int]] = None
    chosen_ids: Optional[list[int]] = None
    rejected_ids: Optional[list[int]] = None


def _read_rows(path: str) -> list[tuple[str, Any]]:
    """(location, raw row) pairs; a JSON syntax error is a malformed row at its line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {path} does not exist")
    if path.endswith(".parquet"):
        # Imported here: datasets is slow to import (start-up time).
        import datasets

        table = datasets.Dataset.from_parquet(path)
        return [(f"{path} row {i}", row) for i, row in enumerate(table)]
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as err:
                rows.append((f"{path}:{number}", MalformedRowError(f"{path}:{number}: not valid JSON ({err.msg})")))
    return rows


def _encode_prompt(value, tokenizer, config: DataConfig, where: str) -> list[int]:
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        messages = value
    else:
        raise MalformedRowError(f"{where}: '{config.input_key}' must be text or a list of {{role, content}} messages")
    if config.apply_chat_template:
        return apply_chat_template(tokenizer, messages)
    if not isinstance(value, str):
        raise MalformedRowError(f"{where}: chat messages need apply_chat_template=True")
    return tokenizer(value, add_special_tokens=False)["input_ids"]


def _encode_text(tokenizer, text, where: str, key: str, eos: bool = True) -> list[int]:
    if not isinstance(text, str) or not text:
        raise MalformedRowError(f"{where}: '{key}' must be a non-empty string")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if eos and tokenizer.eos_token_id is not None else [])


def _parse_row(row, where: str, config: DataConfig, tokenizer) -> Example:
    if isinstance(row, MalformedRowError):
        raise row
    if not isinstance(row, dict):
        raise MalformedRowError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if config.kind == "sft" and config.messages_key in row:
        messages = row[config.messages_key]
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
            raise MalformedRowError(f"{where}: '{config.messages_key}' must end with an assistant message")
        prompt_ids = _encode_prompt(messages[:-1], tokenizer, config, where)
        return Example(prompt_ids, where, response_ids=_encode_text(tokenizer, messages[-1].get("content"), where, "content"))
    if config.input_key not in row:
        raise MalformedRowError(f"{where}: missing key '{config.input_key}' (has {sorted(row)})")
    prompt_ids = _encode_prompt(row[config.input_key], tokenizer, config, where)
    if config.kind == "prompt":
        metadata = row.get(config.metadata_key) or {}
        if not isinstance(metadata, dict):
            raise MalformedRowError(f"{where}: '{config.metadata_key}' must be an object")
        return Example(prompt_ids, where, label=row.get(config.label_key), metadata=metadata)
    if config.kind == "sft":
        return Example(prompt_ids, where, response_ids=_encode_text(tokenizer, row.get(config.response_key), where,
                                                                    config.response_key))
    return Example(prompt_ids, where,
                   chosen_ids=_encode_text(tokenizer, row.get(config.chosen_key), where, config.chosen_key),
                   rejected_ids=_encode_text(tokenizer, row.get(config.rejected_key), where, config.rejected_key))


def load_examples(config: DataConfig, tokenizer) -> list[Example]:
    """Every usable row of `config.path`; malformed rows fail or are skipped per the config."""
    examples, skipped = [], 0
    for where, row in _read_rows(config.path):
        try:
            examples.append(_parse_row(row, where, config, tokenizer))
        except MalformedRowError as err:
            if config.malformed_rows == "fail":
                raise
            skipped += 1
            logger.warning("skipping malformed row: %s", err)
    if not examples:
        raise ValueError(f"dataset {config.path} has no usable rows ({skipped} malformed)")
    return examples


class EpochLoader:
    """Batches in a fresh deterministic order each epoch: permutation of epoch e = randperm(seed + e)."""

    def __init__(self, examples: Sequence[Example], *, seed: int = 0, shuffle: bool = True):
        self.examples = list(examples)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.examples)))
        return torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next_batch(self, batch_size: int) -> list[Example]:
        batch = []
        while len(batch) < batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            batch.append(self.examples[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != len(self.examples) or state["seed"] != self.seed:
            raise ValueError(f"data state was saved for {state['num_examples']} examples / seed {state['seed']}, "
                             f"this loader has {len(self.examples)} / seed {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)


def load_trajectory_corpus(path: str) -> list[dict]:
    """Trajectory replay: a JSONL of saved teacher samples (`Sample.to_json()` rows), validated."""
    required = ("prompt_ids", "response_ids", "loss_mask")
    corpus = []
    for where, row in _read_rows(path):
        if isinstance(row, MalformedRowError):
            raise row
        missing = [k for k in required if k not in row]
        if missing:
            raise MalformedRowError(f"{where}: trajectory row lacks {missing}")
        if len(row["loss_mask"]) != len(row["response_ids"]):
            raise MalformedRowError(f"{where}: loss_mask has {len(row['loss_mask'])} entries for "
                                    f"{len(row['response_ids'])} response tokens")
        corpus.append(row)
    return corpus
