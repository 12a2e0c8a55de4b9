"""`{out}` in a path setting follows --out: the example configs save beside the run's other outputs."""

from __future__ import annotations

import argparse
import os

import pytest

from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args
from stacx.trainer.config.run import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE_CONFIGS = sorted(name for name in os.listdir(os.path.join(REPO, "examples", "configs")) if name.endswith(".yaml"))


def _run_config(*flags: str):
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(list(flags)))


@pytest.mark.parametrize("name", EXAMPLE_CONFIGS)
def test_an_example_config_saves_under_the_out_the_user_gives(name, tmp_path):
    config = os.path.join(REPO, "examples", "configs", name)
    default = _run_config("--config", config)
    assert default.model.save == os.path.join(default.logging.out, "checkpoints")
    moved = _run_config("--config", config, "--out", str(tmp_path / "mine"))
    assert moved.model.save == str(tmp_path / "mine" / "checkpoints")


def test_the_placeholder_works_in_any_path_setting_and_not_in_out_itself(tmp_path):
    config = _run_config("--out", str(tmp_path), "--export-hf", "{out}/hf", "--save", "{out}/ckpt")
    assert (config.train.export_hf, config.model.save) == (f"{tmp_path}/hf", f"{tmp_path}/ckpt")
    with pytest.raises(ConfigError, match=r"--out.*\{out\}"):
        _run_config("--out", "{out}/x")
