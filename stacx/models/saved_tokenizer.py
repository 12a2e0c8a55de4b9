"""The tokenizer saved in a Hugging Face checkpoint folder, loaded without `AutoTokenizer`'s model registry.

`AutoTokenizer.from_pretrained` resolves the folder's `config.json` to its configuration class before
it looks at `tokenizer_config.json`, and resolving the class imports the family's configuration module
and with it `transformers`' model-loading stack (`torch.distributed.tensor`, sympy, accelerate): 2-5 s
of CPU in every process that loads a tokenizer without building a `transformers` model (the driver, the
preflight, `stacx eval`; `stacx serve` builds one for its KV cache anyway), for a class it then does not
use. A folder whose `tokenizer_config.json` names the generic fast class
(`TokenizersBackend`, which `PreTrainedTokenizerFast` is in transformers 5) beside a `tokenizer.json`, for
a model family whose registered tokenizer `AutoTokenizer` would not substitute (`DIRECT_MODEL_TYPES`),
is loaded with that class directly: `AutoTokenizer` returns that same class built from the same files.
Any other folder goes through `AutoTokenizer`. `tests/models/test_saved_tokenizer.py` checks both
halves against transformers: the same ids, special tokens and chat template as `AutoTokenizer`, and
`DIRECT_MODEL_TYPES` against its tables.
"""

from __future__ import annotations

import json
import os
from typing import Any

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` values of `tokenizer_config.json` that name transformers' generic fast tokenizer."""

DIRECT_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen2_moe")
"""`config.json` model types for which `AutoTokenizer` keeps a generic `tokenizer_class` as it is: none is in
transformers' `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` (whose registered class would replace it) and none
registers the Mistral backend. A folder without `config.json` (a tokenizer alone) is loaded directly too."""


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def loads_without_auto_tokenizer(folder: str) -> bool:
    """True when `folder`'s tokenizer is the generic fast class `AutoTokenizer` would load as it is."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return False
    tokenizer_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    if not isinstance(tokenizer_config, dict) or "auto_map" in tokenizer_config:
        return False
    if tokenizer_config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
        return False
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        return True
    config = _read_json(config_path)
    return isinstance(config, dict) and config.get("model_type") in DIRECT_MODEL_TYPES


def load_saved_tokenizer(folder: str):
    """The tokenizer saved in the local folder `folder` (never a Hub download): the generic fast class
    directly where `loads_without_auto_tokenizer`, else `AutoTokenizer`. Raises what transformers raises
    for a folder without a readable tokenizer."""
    if loads_without_auto_tokenizer(folder):
        # Imported here: transformers is slow to import (start-up time); this class alone is cheap.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
