import pytest

from stacx.trainer.config.run import ConfigError, RunConfig


def test_flat_nested_and_dashed_keys_land_in_their_sections():
    cfg = RunConfig.from_dict({
        "tensor-model-parallel-size": 2,
        "rollout": {"n_samples_per_prompt": 8},
        "custom_module": "my_algo.py",
        "train": {"algorithm": "grpo"}, "algorithm": {"clip_ratio_high": 0.28, "my_temperature": 0.3},
        "use_kl_loss": "true",
    })
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.custom_module == ("my_algo.py",)
    assert cfg.train.algorithm == "grpo"
    assert cfg.algorithm.clip_ratio_high == 0.28 and cfg.algorithm.clip_ratio_low == 0.2
    assert cfg.algorithm.my_temperature == 0.3
    assert cfg.algorithm.use_kl_loss is True
    assert cfg.algorithm.custom_hyperparameters() == {"my_temperature": 0.3}


def test_unknown_keys_are_named_with_suggestions():
    with pytest.raises(ConfigError, match=r"unknown key 'tensor_model_paralel_size' in run.yaml; did you mean tensor_model_parallel_size"):
        RunConfig.from_dict({"tensor_model_paralel_size": 2}, source="run.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.lr'"):
        RunConfig.from_dict({"rollout": {"lr": 1.0}})


def test_wrong_types_are_named():
    with pytest.raises(ConfigError, match="key 'num_steps' in config expects int, got 'ten'"):
        RunConfig.from_dict({"num_steps": "ten"})
    with pytest.raises(ConfigError, match="key 'kl_loss_coef' in config expects float"):
        RunConfig.from_dict({"algorithm": {"kl_loss_coef": "big"}})
    with pytest.raises(ConfigError, match="key 'lr'"):
        RunConfig.from_dict({"lr": [1]})


def test_round_trip_and_replace():
    cfg = RunConfig.from_dict({"lr": 3e-4, "train": {"algorithm": "ppo"}, "algorithm": {"extra": 1}})
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg or again.to_dict() == cfg.to_dict()
    changed = cfg.replace(num_steps=3, kl_loss_coef=0.01)
    assert changed.train.num_steps == 3 and changed.algorithm.kl_loss_coef == 0.01
    assert changed.optim.lr == 3e-4 and changed.algorithm.extra == 1
