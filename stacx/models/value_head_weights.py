"""A critic's value head in a Hugging Face folder: the names it is read under and the one it is written under.

A critic (a role with a value head, `stacx.trainer.runtime.value_head`) maps each token's final hidden state to one
number, V = h w^T + b with w [1, hidden] and b [1]. A Hugging Face folder carries such a head under the names of
the library that trained it:

| names | written by |
| --- | --- |
| `score.weight`, `score.bias` | transformers' `*ForTokenClassification` (with a bias) and `*ForSequenceClassification` (no bias: b = 0), `num_labels` 1, as TRL's `RewardTrainer` trains a reward model |
| `v_head.summary.weight`, `v_head.summary.bias` | TRL's `AutoModelForCausalLMWithValueHead` (the value model of TRL's PPO, before TRL dropped it) |

    head = read_hf_value_head(path, hidden_size)    # HFValueHead(weight, bias, names) or None (no head)

`stacx convert checkpoint-to-hf` of a critic writes `score.weight` and `score.bias` with the config of the model
family's `*ForTokenClassification` and `num_labels` 1 (`value_head_names.token_classification_config`): transformers'
`AutoModelForTokenClassification` loads it, and its logits are the critic's values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from stacx.models.value_head_names import VALUE_HEAD_NAMES, ValueHeadNames


@dataclass(frozen=True, kw_only=True)
class HFValueHead:
    """A value head read from a Hugging Face folder."""

    weight: torch.Tensor
    """[1, hidden]."""
    bias: torch.Tensor
    """[1] (zeros when the folder has no bias)."""
    names: ValueHeadNames
    """The names it was found under."""


class ValueHeadShapeError(ValueError):
    """A folder's value-head tensor does not have a value head's shape; the message names the tensor and file."""


def read_hf_value_head(path: str | os.PathLike, hidden_size: int) -> HFValueHead | None:
    """The value head of Hugging Face folder `path` under any of VALUE_HEAD_NAMES, or None when it has none."""
    from stacx.models.checkpoint import hf_weight_files

    path = os.fspath(path)
    files = hf_weight_files(path)
    for names in VALUE_HEAD_NAMES:
        if names.weight not in files:
            continue
        weight = _read(files, names.weight)
        if tuple(weight.shape) != (1, hidden_size):
            raise ValueHeadShapeError(
                f"{path}: tensor {names.weight!r} ({names.written_by}) has shape {list(weight.shape)}; a value head is "
                f"[1, {hidden_size}] (num_labels 1). A classification head with several labels is not a value head: "
                "pass a folder trained with num_labels 1, or one without the head (the critic's head then starts at 0)")
        if names.bias in files:
            bias = _read(files, names.bias)
            if tuple(bias.shape) != (1,):
                raise ValueHeadShapeError(f"{path}: tensor {names.bias!r} has shape {list(bias.shape)}; a value "
                                          "head's bias is [1] (num_labels 1)")
        else:
            bias = torch.zeros(1, dtype=weight.dtype)
        return HFValueHead(weight=weight, bias=bias, names=names)
    return None


def _read(files: dict[str, str], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name], framework="pt", device="cpu") as handle:
        return handle.get_tensor(name)


__all__ = ["HFValueHead", "ValueHeadShapeError", "read_hf_value_head"]
