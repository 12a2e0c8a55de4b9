"""LoRA's settings and flags (in-process, no ranks): errors name the flag, the config's names are the model's."""

from __future__ import annotations

import pytest

from stacx.models.lora import TARGET_MODULES, LoraSettings, is_adapter_param_name, peft_named_tensors, target_of
from stacx.trainer.config.run import LORA_TARGET_MODULES, ConfigError, RunConfig


def test_the_run_config_knows_the_models_target_names():
    assert LORA_TARGET_MODULES == TARGET_MODULES


def test_lora_flags_reach_the_model_section_and_default_to_full_fine_tuning():
    assert RunConfig.from_dict({}).model.lora_rank == 0
    model = RunConfig.from_dict({"lora-rank": 8, "lora_alpha": 16, "lora_dropout": 0.05,
                                 "lora_target_modules": ["linear_qkv", "experts"]}).model
    assert (model.lora_rank, model.lora_alpha, model.lora_dropout) == (8, 16.0, 0.05)
    assert model.lora_target_modules == ("linear_qkv", "experts")


@pytest.mark.parametrize("values, flag", [
    ({"lora_target_modules": ["q_proj"]}, "--lora-target-modules"),
    ({"lora_dropout": 1.0}, "--lora-dropout"),
    ({"lora_rank": -1}, "--lora-rank"),
    ({"lora_rank": 4, "lora_alpha": 0}, "--lora-alpha"),
])
def test_a_wrong_lora_flag_is_named(values, flag):
    with pytest.raises(ConfigError, match=flag):
        RunConfig.from_dict(values)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(rank=0, alpha=8), "--lora-rank"), (dict(rank=4, alpha=0), "--lora-alpha"),
    (dict(rank=4, alpha=8, dropout=-0.1), "--lora-dropout"),
    (dict(rank=4, alpha=8, target_modules=("mlp",)), "--lora-target-modules"),
    (dict(rank=4, alpha=8, target_modules=()), "--lora-target-modules"),
])
def test_lora_settings_refuse_bad_values_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LoraSettings(**kwargs)


def test_all_linear_expands_and_the_scale_is_alpha_over_rank():
    settings = LoraSettings(rank=8, alpha=16)
    assert settings.targets == frozenset(TARGET_MODULES) and settings.scale == 2.0


def test_module_names_map_to_targets():
    assert target_of("decoder.layers.3.self_attention.linear_qkv") == "linear_qkv"
    assert target_of("decoder.layers.0.mlp.shared_experts.linear_fc1") == "linear_fc1"
    assert target_of("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2") == "experts"
    assert target_of("decoder.layers.0.mlp.router") is None
    assert is_adapter_param_name("decoder.layers.0.mlp.linear_fc1.lora_b")
    assert not is_adapter_param_name("decoder.layers.0.mlp.linear_fc1.weight")


def test_a_fused_linears_one_a_is_repeated_for_each_peft_module():
    import torch

    a, b = torch.ones(2, 3), torch.zeros(4, 2)
    named = peft_named_tensors([("model.layers.0.self_attn.q_proj.lora_A.weight", a),
                                ("model.layers.0.self_attn.q_proj.lora_B.weight", b)])
    prefix = "base_model.model.model.layers.0.self_attn."
    assert set(named) == {prefix + "q_proj.lora_A.weight", prefix + "k_proj.lora_A.weight",
                          prefix + "v_proj.lora_A.weight", prefix + "q_proj.lora_B.weight"}


def test_an_adapter_sync_starts_the_cpu_server_with_the_runs_lora_flags():
    from stacx.launch.cli import build_parser
    from stacx.trainer.config.run import engine_lora_flags

    model = RunConfig.from_dict({"lora_rank": 8, "lora_alpha": 16, "lora_target_modules": ["linear_qkv", "experts"],
                                 "lora_sync": "adapters"}).model
    flags = engine_lora_flags(model)
    args = build_parser().parse_args(["serve", "--hf-checkpoint", "x", *flags])
    assert (args.lora_rank, args.lora_alpha, args.lora_target_modules) == (8, 16.0, ["linear_qkv", "experts"])
    assert engine_lora_flags(RunConfig.from_dict({"lora_rank": 8}).model) == ()  # merged pushes: a plain server
    with pytest.raises(ConfigError, match="--lora-sync"):
        RunConfig.from_dict({"lora_sync": "both"})
