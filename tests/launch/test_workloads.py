"""The workload registry: a third-party modality found through a `stacx.workloads` entry point runs end to
end through `stacx train` (in-process driver); the registry's refusals name what to fix."""

import json
import sys
from importlib import metadata

import pytest

from stacx.launch import workloads
from stacx.launch.cli import main
from stacx.trainer.config.recipe import TRAINING_CONFIGS, ModelRole, RecipeError, TrainingConfig
from stacx.trainer.config.workload import WORKLOADS, Workload, get_workload, register_workload, unregister_workload

PLUGIN = "tests.launch.toy_workload_plugin"


@pytest.fixture
def points_workload(monkeypatch):
    """The toy plugin, discovered as an installed package's entry point would be; removed afterwards."""
    entry = metadata.EntryPoint(name="points", value=PLUGIN, group=workloads.ENTRY_POINT_GROUP)
    monkeypatch.setattr(workloads, "workload_entry_points", lambda: [entry])
    monkeypatch.setattr(workloads, "_discovered", False)
    workloads.discover_workloads()
    yield get_workload("points")
    unregister_workload("points")
    TRAINING_CONFIGS.pop("toy_points_fit", None)
    sys.modules.pop(PLUGIN, None)


def test_a_plugin_modality_runs_end_to_end_through_stacx_train(points_workload, tmp_path, capsys):
    assert TRAINING_CONFIGS["toy_points_fit"].modality == "points"
    flags = ["train", "--algorithm", "toy_points_fit", "--num-steps", "6", "--lr", "0.3", "--out", str(tmp_path),
             "--no-progress-bar", "--no-tensorboard", "--rollout-batch-size"]
    assert main([*flags, "4", "--dry-run"]) == 0
    assert "points workload: toy_points_fit, 6 steps" in capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl").exists()  # --dry-run starts nothing
    assert main([*flags, "4"]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < 0.05 * losses[0]  # the plugin's runtime trained
    assert main([*flags, "1"]) == 2  # the driver's refusal: exit 2, named
    assert "--rollout-batch-size 1: the points workload needs at least 2" in capsys.readouterr().err


def test_a_recipe_of_an_unregistered_modality_or_foreign_loss_class_is_refused():
    role = ModelRole(name="policy", specialization_cls=object)
    with pytest.raises(RecipeError, match=r"unknown name 'voxels'; known: text, image.*register_workload"):
        TrainingConfig(name="voxel_fit", description="d", roles=(role,), data_source="dataset", modality="voxels")
    with pytest.raises(RecipeError, match=r"specialization_cls.*DiffusionObjective"):
        TrainingConfig(name="image_fit", description="d", roles=(role,), data_source="dataset", modality="image")


def test_the_registry_refuses_a_second_workload_for_a_modality_and_names_the_registered_ones():
    image = get_workload("image")
    assert register_workload(image) is image  # the same module imported twice
    with pytest.raises(ValueError, match=r"workload 'image' is already registered \(by stacx.diffusion"):
        register_workload(Workload(modality="image", description="other", driver=dict, objective_base=object,
                                   runtime=dict))
    with pytest.raises(ValueError, match=r"workload 'text' is already registered"):  # the core's own workload
        register_workload(Workload(modality="text", description="d", driver=dict, objective_base=object, runtime=dict))
    with pytest.raises(ValueError, match=r"unknown workload 'voxels'; registered modalities: image, text"):
        get_workload("voxels")
    with pytest.raises(ValueError, match=r"unknown workload 'imag'; did you mean 'image'\?"):
        get_workload("imag")
    assert set(WORKLOADS) == {"image", "text"}


def test_text_is_a_workload_like_the_others(monkeypatch):
    from stacx.launch.commands import train
    from stacx.specializations.base import Specialization
    from stacx.trainer.config.run import ConfigError, RunConfig
    from stacx.trainer.recipes import get_recipe

    text, grpo = get_workload("text"), get_recipe("grpo")
    assert text.objective_base is Specialization
    # Built like every workload's driver, it runs the preflight: a run it would refuse is refused here.
    with pytest.raises(ConfigError, match="--hf-checkpoint /nonexistent/ckpt: no such folder"):
        text.driver(RunConfig.from_dict({"hf_checkpoint": "/nonexistent/ckpt"}), grpo)
    # `stacx train` launches a text recipe through the one path of the registered workloads.
    launched = []
    monkeypatch.setattr(train, "run_workload", lambda workload, run_config, recipe: launched.append(
        (workload, recipe.name)) or 0)
    assert main(["train", "--algorithm", "grpo", "--dry-run"]) == 0
    assert launched == [(text, "grpo")]


def test_a_failing_entry_point_is_named(monkeypatch):
    entry = metadata.EntryPoint(name="broken", value="tests.launch.no_such_module", group=workloads.ENTRY_POINT_GROUP)
    monkeypatch.setattr(workloads, "workload_entry_points", lambda: [entry])
    monkeypatch.setattr(workloads, "_discovered", False)
    with pytest.raises(ImportError, match=r"stacx.workloads entry point 'broken' = 'tests.launch.no_such_module'"):
        workloads.discover_workloads()
