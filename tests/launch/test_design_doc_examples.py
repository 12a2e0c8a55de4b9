"""The design documents' examples as written (package path changed only), each trained for 2 steps
through `stacx train` (issue 13, item 3). The example files live in `examples/seed_000/`,
`examples/seed_001/` and `examples/seed_003/`; docs/objectives.md and docs/adding-an-algorithm.md
show them.

Each example runs on ONE launcher, the launchers alternating, so that each way of bringing user
code in runs on both: a `--custom-module` file (torchrun: seed_000, seed_001's YAML; Ray: seed_003,
seed_001's REINFORCE) and a Python config object (both). The custom folder runs on Ray, where the
folder must reach the workers (torchrun ranks import it like the driver does). How user code
reaches every rank is tested on both launchers in test_custom_code_on_every_rank.py; a run costs
30-50 s on two cores, so the examples are not repeated per launcher."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.launch.test_custom_code_on_every_rank import LAUNCHERS, REPO, SMALL_ROLLOUT, run_stacx_train, tiny_checkpoint  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEED_000 = [os.path.join(REPO, "examples", "seed_000", name) for name in ("reward_centered.py", "vanilla_pg.py")]
SEED_003 = os.path.join(REPO, "examples", "seed_003", "my_algo.py")


def _check_guide_000_run(steps: list[dict]) -> None:
    for step in steps:
        # vanilla_pg's metric, a python float sum, divided by the global loss-token count.
        assert "policy/approx_kl" in step and abs(step["policy/approx_kl"]) < 1e-3
        assert step["policy/num_loss_tokens"] > 0


@pytest.mark.parametrize("launcher", ["torchrun"])
def test_guide_000_examples_passed_with_custom_module(launcher, tiny_checkpoint, tmp_path):
    """Both examples reuse built-in names; only `advantage_estimator` names the custom estimator
    (the generic actor recipe runs it)."""
    flags = [arg for path in SEED_000 for arg in ("--custom-module", path)]
    steps = run_stacx_train(launcher, [*flags, "--advantage-estimator", "reward_centered", "--policy-loss", "vanilla_pg",
                                       "--hf-checkpoint", tiny_checkpoint, *SMALL_ROLLOUT], str(tmp_path / "out"))
    _check_guide_000_run(steps)


@pytest.mark.parametrize("launcher", ["ray"])
def test_guide_000_examples_placed_in_the_custom_folder(launcher, tiny_checkpoint, tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    for path in SEED_000:
        shutil.copy(path, folder / os.path.basename(path))
    steps = run_stacx_train(launcher, ["--advantage-estimator", "reward_centered", "--policy-loss", "vanilla_pg",
                                       "--hf-checkpoint", tiny_checkpoint, *SMALL_ROLLOUT], str(tmp_path / "out"),
                            custom_dirs=(str(folder),))
    _check_guide_000_run(steps)


@pytest.mark.parametrize("launcher", ["ray"])
def test_guide_003_specialization_and_recipe_with_its_launch_line(launcher, tiny_checkpoint, tmp_path):
    steps = run_stacx_train(launcher, ["--custom-module", SEED_003, "--algorithm", "my_algo",
                                       "--hf-checkpoint", tiny_checkpoint, "--ref-load", tiny_checkpoint, *SMALL_ROLLOUT],
                            str(tmp_path / "out"))
    for step in steps:
        # `my_loss` is a sum over loss tokens: with token-mean it is logged as the step's loss.
        assert step["policy/my_loss"] == pytest.approx(step["policy/loss"], rel=1e-6)
        assert step["policy/loss"] > 0.5  # the NLL of a barely trained tiny model


SEED_001 = os.path.join(REPO, "examples", "seed_001")


@pytest.mark.parametrize("launcher", ["torchrun"])
def test_guide_001_my_algorithm_with_its_yaml(launcher, tiny_checkpoint, tmp_path):
    steps = run_stacx_train(launcher, ["--custom-module", os.path.join(SEED_001, "my_algorithm.py"), "--config",
                                       os.path.join(SEED_001, "my_algorithm.yaml"), "--hf-checkpoint", tiny_checkpoint,
                                       *SMALL_ROLLOUT], str(tmp_path / "out"))
    for step in steps:  # the plugin's metrics, as means over the loss tokens
        assert step["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-3) and "policy/clip_frac" in step


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_guide_001_python_config_object(launcher, tiny_checkpoint, tmp_path):
    """`import my_algorithm` then `StacxConfig(model_path=..., algorithm={name, adv_estimator, clip_ratio})`."""
    import json
    import subprocess
    import sys

    from tests.launch.test_custom_code_on_every_rank import TORCHRUN, train_env

    out = str(tmp_path / "out")
    script = os.path.join(REPO, "tests", "launch", "train_python_config.py")
    if launcher == "ray":
        command = [sys.executable, script, tiny_checkpoint, out]
    else:
        command = [TORCHRUN, "--standalone", "--nproc-per-node=2", script, tiny_checkpoint, out, "2"]
    completed = subprocess.run(command, env=train_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-5000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == 2 and all("policy/ratio_mean" in step for step in steps)


@pytest.mark.parametrize("launcher", ["ray"])
def test_guide_001_complete_custom_reinforce(launcher, tiny_checkpoint, tmp_path):
    steps = run_stacx_train(launcher, ["--custom-module", os.path.join(SEED_001, "custom_reinforce.py"),
                                       "--advantage-estimator", "reinforce_baseline", "--policy-loss", "reinforce_pg",
                                       "--hf-checkpoint", tiny_checkpoint, *SMALL_ROLLOUT], str(tmp_path / "out"))
    for step in steps:
        assert step["policy/entropy"] > 0 and "policy/pg_loss" in step
