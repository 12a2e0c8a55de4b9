"""The design documents' examples as written (package path changed only), each trained for 2 steps
through `stacx train` (issue 13, item 3). The example files live in `examples/estimator_and_loss/`,
`examples/padded_plugins/` and `examples/specialization_in_one_file/`; docs/objectives.md and docs/adding-an-algorithm.md
show them.

Each example runs once, on one launcher, and each way of bringing user code in runs at least once:
a `--custom-module` file (torchrun: padded_plugins/my_algorithm.yaml; Ray: specialization_in_one_file, padded_plugins/custom_reinforce.py), the
custom folder (Ray, estimator_and_loss: the folder must reach workers that never see the driver's files) and a
Python config object (Ray, where the module it imports must be shipped to the workers; under
torchrun every rank runs the script itself). The Ray runs attach to the shared test cluster. How
user code reaches every rank is tested on both launchers in test_custom_code_on_every_rank.py."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.launch.test_custom_code_on_every_rank import (  # noqa: F401
    PER_EXPERT_LOAD, REPO, SMALL_ROLLOUT, assert_moe_steps_trained_on_both_expert_ranks, run_stacx_train, tiny_checkpoint,
    tiny_moe_checkpoint)
from tests.warm import warm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEED_000 = [os.path.join(REPO, "examples", "estimator_and_loss", name) for name in ("reward_centered.py", "vanilla_pg.py")]
SEED_003 = os.path.join(REPO, "examples", "specialization_in_one_file", "my_algo.py")


def _check_guide_000_run(steps: list[dict]) -> None:
    for step in steps:
        # vanilla_pg's metric, a python float sum, divided by the global loss-token count.
        assert "policy/approx_kl" in step and abs(step["policy/approx_kl"]) < 1e-3
        assert step["policy/num_loss_tokens"] > 0


@pytest.mark.parametrize("launcher", ["ray"])
def test_guide_000_examples_placed_in_the_custom_folder(launcher, tiny_checkpoint, tmp_path, shared_ray_address):
    """Both examples reuse built-in names; only `advantage_estimator` names the custom estimator
    (the generic actor recipe runs it)."""
    folder = tmp_path / "custom"
    folder.mkdir()
    for path in SEED_000:
        shutil.copy(path, folder / os.path.basename(path))
    steps = run_stacx_train(launcher, ["--advantage-estimator", "reward_centered", "--policy-loss", "vanilla_pg",
                                       "--hf-checkpoint", tiny_checkpoint, *SMALL_ROLLOUT], str(tmp_path / "out"),
                            custom_dirs=(str(folder),), ray_address=shared_ray_address)
    _check_guide_000_run(steps)


@pytest.mark.parametrize("launcher", ["ray"])
def test_guide_003_specialization_and_recipe_with_its_launch_line(launcher, tiny_checkpoint, tmp_path, shared_ray_address):
    steps = run_stacx_train(launcher, ["--custom-module", SEED_003, "--algorithm", "my_algo",
                                       "--hf-checkpoint", tiny_checkpoint, "--ref-load", tiny_checkpoint, *SMALL_ROLLOUT],
                            str(tmp_path / "out"), ray_address=shared_ray_address)
    for step in steps:
        # `my_loss` is a sum over loss tokens: with token-mean it is logged as the step's loss.
        assert step["policy/my_loss"] == pytest.approx(step["policy/loss"], rel=1e-6)
        assert step["policy/loss"] > 0.5  # the NLL of a barely trained tiny model


SEED_001 = os.path.join(REPO, "examples", "padded_plugins")


@pytest.mark.parametrize("launcher", ["torchrun"])
def test_guide_001_my_algorithm_with_its_yaml(launcher, tiny_moe_checkpoint, tmp_path):
    """The plugins on the actor (GRPO) recipe under torchrun, with a Qwen3-MoE model's experts on the two
    ranks (--expert-model-parallel-size 2; the same on Ray: test_custom_code_on_every_rank.py)."""
    steps = run_stacx_train(launcher, ["--custom-module", os.path.join(SEED_001, "my_algorithm.py"), "--config",
                                       os.path.join(SEED_001, "my_algorithm.yaml"), "--hf-checkpoint", tiny_moe_checkpoint,
                                       "--expert-model-parallel-size", "2", *PER_EXPERT_LOAD, *SMALL_ROLLOUT],
                            str(tmp_path / "out"))
    for step in steps:  # the plugin's metrics, as means over the loss tokens
        assert step["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-3) and "policy/clip_frac" in step
    assert_moe_steps_trained_on_both_expert_ranks(steps)


def test_guide_001_python_config_object_on_ray(tiny_checkpoint, tmp_path, shared_ray_address):
    """`import my_algorithm` then `StacxConfig(model_path=..., algorithm={name, adv_estimator, clip_ratio})`;
    the run attaches to the cluster named by RAY_ADDRESS, as under `ray job submit`."""
    import json
    import subprocess

    from tests.launch.test_custom_code_on_every_rank import train_env

    out = str(tmp_path / "out")
    script = os.path.join(REPO, "tests", "launch", "train_python_config.py")
    completed = subprocess.run([warm_python(), script, tiny_checkpoint, out], env=train_env({"RAY_ADDRESS": shared_ray_address}),
                               capture_output=True, text=True, timeout=600, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-5000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == 2 and all("policy/ratio_mean" in step for step in steps)


@pytest.mark.parametrize("launcher", ["ray"])
def test_guide_001_complete_custom_reinforce(launcher, tiny_checkpoint, tmp_path, shared_ray_address):
    steps = run_stacx_train(launcher, ["--custom-module", os.path.join(SEED_001, "custom_reinforce.py"),
                                       "--advantage-estimator", "reinforce_baseline", "--policy-loss", "reinforce_pg",
                                       "--hf-checkpoint", tiny_checkpoint, *SMALL_ROLLOUT], str(tmp_path / "out"),
                            ray_address=shared_ray_address)
    for step in steps:
        assert step["policy/entropy"] > 0 and "policy/pg_loss" in step
