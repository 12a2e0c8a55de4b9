"""`load_saved_tokenizer` loads what `AutoTokenizer` loads, without resolving the model's config class.

In-process: each folder is a saved tokenizer (and a `config.json` naming a model type), compared with
`AutoTokenizer.from_pretrained` of the same folder on ids, special tokens, vocabulary and chat template.
"""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.auto.tokenization_auto import (
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
    TOKENIZER_MAPPING_NAMES,
)

from stacx.models.saved_tokenizer import DIRECT_MODEL_TYPES, load_saved_tokenizer, loads_without_auto_tokenizer
from stacx.rollout.agents.chat_tokenizers import STYLES, build_tool_chat_tokenizer
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.tasks import TASKS, write_tiny_checkpoint

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+7="},
            {"role": "assistant", "content": "19"}, {"role": "user", "content": "sort 31="}]


def save_tokenizer(folder, tokenizer, model_type: str | None, tokenizer_class: str | None = None) -> str:
    tokenizer.save_pretrained(str(folder))
    if model_type is not None:
        with open(os.path.join(folder, "config.json"), "w") as handle:
            json.dump({"model_type": model_type, "vocab_size": len(tokenizer)}, handle)
    if tokenizer_class is not None:
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as handle:
            config = json.load(handle)
        with open(path, "w") as handle:
            json.dump({**config, "tokenizer_class": tokenizer_class}, handle)
    return str(folder)


def assert_same_tokenizer(folder: str, text: str) -> None:
    ours, theirs = load_saved_tokenizer(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.pad_token_id, ours.eos_token_id, ours.bos_token_id, ours.unk_token_id) == \
        (theirs.pad_token_id, theirs.eos_token_id, theirs.bos_token_id, theirs.unk_token_id)
    assert ours.chat_template == theirs.chat_template
    assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.decode(ours(text)["input_ids"]) == theirs.decode(theirs(text)["input_ids"])


@pytest.mark.parametrize("task_name", sorted(TASKS))
def test_every_built_in_tasks_tokenizer_loads_as_auto_tokenizer_loads_it(task_name, tmp_path):
    task = TASKS.get(task_name)
    for model_type in DIRECT_MODEL_TYPES:
        folder = save_tokenizer(tmp_path / model_type, build_char_tokenizer(task.alphabet), model_type)
        assert loads_without_auto_tokenizer(folder)
        assert_same_tokenizer(folder, task.alphabet * 2)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_tool_chat_tokenizers_load_as_auto_tokenizer_loads_them(style, tmp_path):
    folder = save_tokenizer(tmp_path, build_tool_chat_tokenizer(style), "qwen3")
    assert loads_without_auto_tokenizer(folder)
    assert_same_tokenizer(folder, "<tool_call>{\"a\": 1}</tool_call> 12+7")


def test_write_tiny_checkpoints_folder_loads_as_auto_tokenizer_loads_it(tmp_path):
    folder = write_tiny_checkpoint(str(tmp_path / "sorting"), "sorting")
    assert loads_without_auto_tokenizer(folder)
    assert_same_tokenizer(folder, "31415=")


@pytest.mark.parametrize("case", ["older PreTrainedTokenizerFast spelling", "no config.json"])
def test_a_generic_class_spelled_the_older_way_or_without_a_config_loads_directly(case, tmp_path):
    older = case.startswith("older")
    folder = save_tokenizer(tmp_path, build_char_tokenizer("0123="), "llama" if older else None,
                            tokenizer_class="PreTrainedTokenizerFast" if older else None)
    assert loads_without_auto_tokenizer(folder)
    assert_same_tokenizer(folder, "30=1")


@pytest.mark.parametrize("change", ["qwen2 model type", "named class", "auto_map", "no tokenizer.json"])
def test_any_other_folder_goes_through_auto_tokenizer(change, tmp_path):
    """qwen2 is one of transformers' families whose registered tokenizer replaces a generic class."""
    model_type = "qwen2" if change == "qwen2 model type" else "llama"
    folder = save_tokenizer(tmp_path, build_char_tokenizer("0123="), model_type,
                            tokenizer_class="Qwen2Tokenizer" if change == "named class" else None)
    edits = {"auto_map": {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}}.get(change)
    if edits:
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as handle:
            config = json.load(handle)
        with open(path, "w") as handle:
            json.dump({**config, **edits}, handle)
    if change == "no tokenizer.json":
        os.remove(os.path.join(folder, "tokenizer.json"))
    assert not loads_without_auto_tokenizer(folder)
    if change == "qwen2 model type":  # the fallback is AutoTokenizer's own answer
        assert type(load_saved_tokenizer(folder)) is type(AutoTokenizer.from_pretrained(folder, local_files_only=True))


def test_the_direct_model_types_are_ones_auto_tokenizer_leaves_a_generic_class_to():
    """If transformers starts substituting its registered tokenizer for one of these families (its
    `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, or the Mistral backend), the direct load would differ."""
    for model_type in DIRECT_MODEL_TYPES:
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, model_type
        assert (TOKENIZER_MAPPING_NAMES.get(model_type) or "") != "MistralCommonBackend", model_type
    assert PreTrainedTokenizerFast.__name__ == "TokenizersBackend"
