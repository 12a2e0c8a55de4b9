"""The public front door: the names a user writes recipes, objectives and run configs with import
from `stacx` (and the config names from `stacx.trainer.config`), and are the framework's own objects."""

import subprocess
import sys

import pytest

from stacx.objectives import registry
from stacx.rollout import environments, rewards, tools
from stacx.rollout.engines import registry as engine_registry
from stacx.trainer.config import python as python_config
from stacx.trainer.config import recipe as recipe_module

FRONT_DOOR = ("recipe", "TrainingConfig", "ModelRole", "InjectSync", "ExchangeSync", "register_advantage",
              "register_policy_loss", "register_reward", "register_engine", "StacxConfig", "Environment", "StepResult",
              "register_environment", "register_tool")


def test_every_front_door_name_is_the_defining_modules_object():
    import stacx

    owners = {"register_advantage": registry, "register_policy_loss": registry, "register_reward": rewards,
              "register_engine": engine_registry, "StacxConfig": python_config, "Environment": environments,
              "StepResult": environments, "register_environment": environments, "register_tool": tools}
    for name in FRONT_DOOR:
        assert getattr(stacx, name) is getattr(owners.get(name, recipe_module), name), name
    assert set(FRONT_DOOR) <= set(stacx.__all__) and set(FRONT_DOOR) <= set(dir(stacx))


def test_the_config_package_offers_the_recipe_model():
    from stacx.trainer.config import ExchangeSync, InjectSync, ModelRole, StacxConfig, TrainingConfig

    assert (TrainingConfig, ModelRole, InjectSync, ExchangeSync, StacxConfig) == (
        recipe_module.TrainingConfig, recipe_module.ModelRole, recipe_module.InjectSync, recipe_module.ExchangeSync,
        python_config.StacxConfig)


@pytest.mark.slow
def test_a_fresh_interpreter_imports_the_front_door_in_one_line_and_import_stacx_stays_light():
    code = ("import sys, stacx; light = 'torch' not in sys.modules and 'ray' not in sys.modules; "
            "from stacx import " + ", ".join(FRONT_DOOR) + "; print(light, TrainingConfig.__name__)")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["True", "TrainingConfig"]


def test_an_unknown_name_is_an_attribute_error_naming_it():
    import pytest

    import stacx

    with pytest.raises(AttributeError, match="no attribute 'TrainingConfg'"):
        stacx.TrainingConfg  # noqa: B018
