"""`DiffusionAlgorithmConfig`: the diffusion knobs are declared fields of an `AlgorithmConfig`, layered
defaults < recipe < user, converted from command-line text, and the LLM's `dpo_beta` is refused."""

import argparse
import pickle

import pytest

from stacx.diffusion.algorithm_config import DiffusionAlgorithmConfig, diffusion_fields, resolve_diffusion_algorithm
from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args
from stacx.objectives.algorithm_config import AlgorithmConfig, AlgorithmConfigError
from stacx.trainer.recipes import TRAINING_CONFIGS


def _run_config(*flags):
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(list(flags)))


def test_the_run_layers_user_values_over_the_recipe_defaults_as_typed_fields():
    recipe = TRAINING_CONFIGS["mix_grpo"]
    config = resolve_diffusion_algorithm(recipe, _run_config(
        "--algorithm", "mix_grpo", "--algorithm-param", "sde_eta=0.25", "--algorithm-param", "shared_group_noise=false",
        "--algorithm-param", "my_kernel_knob=3", "--kl-loss-coef", "0.5", "--reward-fn", "color"))
    assert isinstance(config, DiffusionAlgorithmConfig) and isinstance(config, AlgorithmConfig)
    assert (config.sde_eta, config.shared_group_noise) == (0.25, False)  # the user's
    assert (config.sde_window_size, config.sde_window_shift_every) == (2, 2)  # the recipe's
    assert config.num_inference_steps == 6 and config.diffusion_dpo_beta == 100.0  # the declared defaults
    assert config.kl_loss_coef == 0.5 and config.policy_loss == "flow_grpo_clip"
    assert config.image_reward == "color" and dict(config.extras) == {"my_kernel_knob": 3}
    assert {f.name for f in diffusion_fields()}.isdisjoint(config.extras)
    rebuilt = pickle.loads(pickle.dumps(config))  # what a Ray worker receives
    assert type(rebuilt) is DiffusionAlgorithmConfig and rebuilt == config


def test_names_that_mean_two_things_or_nothing_are_refused_with_the_name_to_use():
    with pytest.raises(AlgorithmConfigError, match="reads diffusion_dpo_beta"):
        resolve_diffusion_algorithm(TRAINING_CONFIGS["diffusion_dpo"],
                                    _run_config("--algorithm", "diffusion_dpo", "--dpo-beta", "0.5"))
    with pytest.raises(AlgorithmConfigError, match="did you mean 'sde_window_size'"):
        DiffusionAlgorithmConfig.from_values({"sde_window_sise": 2})
    with pytest.raises(AlgorithmConfigError, match=r"algorithm.num_inference_steps expects int, got 'six'"):
        DiffusionAlgorithmConfig.from_values({"num_inference_steps": "six"})
    with pytest.raises(AlgorithmConfigError, match="sde_window_size 6 must be in"):
        DiffusionAlgorithmConfig(sde_window_size=6)
