"""A Hugging Face `config.json` read without importing `transformers`.

Every role worker, torchrun rank and engine builds its model from a config.json. Reading it through
`transformers.AutoConfig` imports the library and the family's configuration module (which pulls the
rope utilities): about 2 s of CPU in every process that starts, for a dozen numbers. `HuggingFaceConfig`
reads the file as JSON and answers the fields Stacx reads with the family's class defaults where the
file leaves one out (`CLASS_DEFAULTS`, checked against `transformers` by
`tests/models/test_hf_config.py`). Where a real `transformers.PretrainedConfig` is needed (building a
`transformers` model, writing an export) `to_transformers()` makes one from the same fields.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

_DENSE_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "dtype": None,
}

CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_DENSE_DEFAULTS, "mlp_bias": False, "attention_bias": False, "max_position_embeddings": 2048,
              "eos_token_id": 2},
    "qwen2": {**_DENSE_DEFAULTS, "use_sliding_window": False, "max_position_embeddings": 32768,
              "eos_token_id": None, "num_key_value_heads": 32},
    "qwen3": {**_DENSE_DEFAULTS, "use_sliding_window": False, "attention_bias": False,
              "max_position_embeddings": 32768, "eos_token_id": None, "num_key_value_heads": 32, "head_dim": 128},
    "qwen2_moe": {**_DENSE_DEFAULTS, "use_sliding_window": False, "max_position_embeddings": 32768,
                  "eos_token_id": None, "num_key_value_heads": 16, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": False},
    "qwen3_moe": {**_DENSE_DEFAULTS, "use_sliding_window": False, "attention_bias": False,
                  "max_position_embeddings": 32768, "eos_token_id": None, "num_key_value_heads": 4,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False},
}
"""Per `model_type`, the `transformers` config class's default of each optional field Stacx reads (the
model sizes have none here: a config.json without them is refused by the reader that needs them). A
family whose class derives a field from others (Llama: `num_key_value_heads` from the heads, `head_dim`
from the width) leaves it out; `decoder_shape` derives it the same way."""

FIELD_ALIASES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_experts": "num_local_experts"}}
"""Per `model_type`, a field Stacx reads -> the name newer `transformers` versions write it under."""


class HuggingFaceConfig:
    """The fields of one config.json as attributes, family defaults filled in; read-only.

    `getattr(config, field, default)` behaves as on a `transformers` config for the fields Stacx reads:
    the file's value, else the family's class default, else `default`."""

    def __init__(self, fields: Mapping[str, Any]):
        model_type = fields.get("model_type")
        if model_type not in CLASS_DEFAULTS:
            raise ValueError(f"unsupported architecture {model_type!r} (model_type); supported: "
                             f"{sorted(CLASS_DEFAULTS)}")
        object.__setattr__(self, "_fields", dict(fields))

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__["_fields"]
        if name in fields:
            return fields[name]
        alias = FIELD_ALIASES.get(fields["model_type"], {}).get(name)
        if alias is not None and alias in fields:
            return fields[alias]
        defaults = CLASS_DEFAULTS[fields["model_type"]]
        if name in defaults:
            value = defaults[name]
            return list(value) if isinstance(value, list) else value
        raise AttributeError(f"config.json has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"HuggingFaceConfig is read-only (tried to set {name!r})")

    def to_dict(self) -> dict[str, Any]:
        """The fields as the file has them (no defaults filled in)."""
        return dict(self._fields)

    def to_transformers(self):
        """The same config as a `transformers.PretrainedConfig` (imports transformers)."""
        from transformers import AutoConfig

        fields = self.to_dict()
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def __repr__(self) -> str:
        return f"HuggingFaceConfig({self._fields!r})"


def read_hf_config(path: str | os.PathLike) -> HuggingFaceConfig:
    """The config.json of a folder (or the file itself) as a `HuggingFaceConfig`."""
    path = os.fspath(path)
    config_path = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"Hugging Face config not found: {config_path}")
    with open(config_path, encoding="utf-8") as handle:
        fields = json.load(handle)
    if fields.get("model_type") not in CLASS_DEFAULTS:
        raise ValueError(f"unsupported architecture {fields.get('model_type')!r} (model_type in {config_path}); "
                         f"supported: {sorted(CLASS_DEFAULTS)}")
    return HuggingFaceConfig(fields)


def as_transformers_config(config):
    """`config` as a `transformers.PretrainedConfig` (converted when it is a `HuggingFaceConfig`)."""
    return config.to_transformers() if isinstance(config, HuggingFaceConfig) else config
