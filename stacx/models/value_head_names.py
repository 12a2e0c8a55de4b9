"""The names a value head has in a Hugging Face folder (the table in `stacx.models.value_head_weights`).

The decoder's loader (`stacx.models.checkpoint`) leaves these tensors alone, and a critic's export writes
EXPORT_NAMES with `token_classification_config`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ValueHeadNames:
    """The tensor names one library stores a value head under."""

    weight: str
    """The head's weight, [1, hidden] (a classification head with num_labels 1)."""
    bias: str
    """The head's bias, [1]; a folder without it has none (b = 0)."""
    written_by: str
    """Who writes these names (for log lines and errors)."""


TRANSFORMERS_SCORE = ValueHeadNames(weight="score.weight", bias="score.bias",
                                    written_by="transformers' *ForTokenClassification / *ForSequenceClassification")
TRL_VALUE_HEAD = ValueHeadNames(weight="v_head.summary.weight", bias="v_head.summary.bias",
                                written_by="TRL's AutoModelForCausalLMWithValueHead")
VALUE_HEAD_NAMES = (TRANSFORMERS_SCORE, TRL_VALUE_HEAD)
"""Every naming read, in the order tried."""
EXPORT_NAMES = TRANSFORMERS_SCORE
"""The names a critic's export writes."""


def value_head_tensor_names() -> frozenset[str]:
    """Every tensor name a value head may have in a Hugging Face folder (the decoder's loader leaves them alone)."""
    return frozenset(name for names in VALUE_HEAD_NAMES for name in (names.weight, names.bias))


def token_classification_config(config):
    """`config` (a transformers config) as the config of its family's *ForTokenClassification with one label."""
    from stacx.models.architectures import ARCHITECTURES

    causal = ARCHITECTURES[config.model_type].hf_class_name
    config.architectures = [causal.replace("ForCausalLM", "ForTokenClassification")]
    config.num_labels = 1
    return config


__all__ = ["EXPORT_NAMES", "TRANSFORMERS_SCORE", "TRL_VALUE_HEAD", "VALUE_HEAD_NAMES", "ValueHeadNames",
           "token_classification_config", "value_head_tensor_names"]
