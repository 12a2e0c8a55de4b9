"""`HuggingFaceConfig` (config.json read without `transformers`) gives every reader what
`transformers.AutoConfig` gives it: the class defaults, the field aliases, both rope layouts."""

from __future__ import annotations

import json
import pytest
from transformers import AutoConfig

from stacx.models.architectures import ARCHITECTURES, decoder_shape, load_hf_config
from stacx.models.hf_config import CLASS_DEFAULTS, HuggingFaceConfig, read_hf_config
from stacx.models.testing import tiny_hf_config

FAMILIES = sorted(ARCHITECTURES)
_MISSING = object()


def test_every_supported_family_has_its_class_defaults():
    assert sorted(CLASS_DEFAULTS) == FAMILIES


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_class_defaults_are_transformers_own(model_type):
    reference = AutoConfig.for_model(model_type)
    for field, value in CLASS_DEFAULTS[model_type].items():
        if field == "rope_theta":
            expected = reference.rope_parameters["rope_theta"]
        else:
            expected = getattr(reference, field, _MISSING)
        assert expected is not _MISSING, (model_type, field)
        assert value == expected, (model_type, field, value, expected)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_saved_config_reads_to_the_same_decoder_shape(model_type, tmp_path):
    tiny_hf_config(model_type).save_pretrained(tmp_path)
    light = read_hf_config(tmp_path)
    assert "transformers" not in type(light).__module__
    assert decoder_shape(light) == decoder_shape(AutoConfig.from_pretrained(tmp_path))
    assert decoder_shape(load_hf_config(str(tmp_path))) == decoder_shape(light)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_sparse_config_gets_the_family_defaults(model_type):
    """Only the sizes: every optional field (eps, rope, tied embeddings, positions, biases) is the family's."""
    sizes = {"model_type": model_type, "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 48}
    if ARCHITECTURES[model_type].mixture_of_experts:
        sizes.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if ARCHITECTURES[model_type].shared_expert:
        sizes["shared_expert_intermediate_size"] = 24
    fields = dict(sizes)
    reference = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert decoder_shape(HuggingFaceConfig(sizes)) == decoder_shape(reference)


def test_the_older_rope_layout_and_llama3_scaling_read_as_transformers_reads_them(tmp_path):
    """transformers 4 wrote `rope_theta` at the top and the llama3 scaling as `rope_scaling`."""
    fields = {"model_type": "llama", "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 48, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    light = decoder_shape(read_hf_config(tmp_path))
    assert light.rope_theta == 500000.0 and light.rope_scaling["factor"] == 8.0
    assert light == decoder_shape(AutoConfig.from_pretrained(tmp_path))


def test_qwen3_moe_reads_the_expert_count_under_its_newer_name():
    fields = {"model_type": "qwen3_moe", "num_local_experts": 6}
    assert HuggingFaceConfig(fields).num_experts == 6


def test_refusals_name_the_field_and_the_file(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        HuggingFaceConfig({"model_type": "gpt2"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"model_type in .*config\.json"):
        read_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path / "missing")
    with pytest.raises(AttributeError, match="read-only"):
        HuggingFaceConfig({"model_type": "llama"}).vocab_size = 3


def test_to_transformers_keeps_every_field(tmp_path):
    tiny_hf_config("qwen2_moe").save_pretrained(tmp_path)
    light = read_hf_config(tmp_path)
    converted = light.to_transformers()
    assert converted.to_dict()["shared_expert_intermediate_size"] == light.shared_expert_intermediate_size
    assert decoder_shape(converted) == decoder_shape(light)


@pytest.mark.slow
def test_building_a_model_from_a_folder_imports_no_transformers(tmp_path):
    """What every role worker and rank does at start: its model from config.json, transformers never imported.
    A forked rank stands for the fresh process (it shares none of this test process's modules)."""
    from stacx.testing.distributed import run_distributed
    from tests.models.rank_imports import build_from_folder_imports_transformers

    tiny_hf_config("qwen3").save_pretrained(tmp_path)
    assert run_distributed(build_from_folder_imports_transformers, 1, args=(str(tmp_path),)) == [False]
