"""`stacx train` flags, `--config` merging and `--dry-run`, against the RunConfig they map onto."""

from __future__ import annotations

import argparse
import glob
import os

import pytest

from stacx.launch.cli import build_parser, main
from stacx.launch.run_flags import add_run_config_arguments, flag_name, run_config_from_args
from stacx.rollout.engines.registry import engine_kind_names
from stacx.trainer.config.run import ALGORITHM_FIELDS, FIELDS, ConfigError, RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv: list[str]) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(argv))


@pytest.fixture(scope="module")
def tiny_flags(tmp_path_factory) -> list[str]:
    """Flags naming real inputs (a tiny sorting checkpoint, built-in data, a fresh output folder):
    --dry-run checks them as the run would."""
    from stacx.tasks import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_inputs")
    checkpoint = write_tiny_checkpoint(str(root / "ckpt"), "sorting")
    return ["--hf-checkpoint", checkpoint, "--ref-load", checkpoint, "--prompt-data", "builtin:sorting",
            "--out", str(root / "out"), "--rollout-max-response-len", "6"]


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_every_run_config_field_and_known_algorithm_field_has_one_flag():
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    for name in FIELDS:
        assert flag_name(name) in flags, name
    for name in ALGORITHM_FIELDS:
        if name != "name":
            assert flag_name(name) in flags, name
    # Booleans are --flag/--no-flag; the Megatron-style names the docs promise exist.
    for expected in ("--use-critic", "--no-use-critic", "--use-kl-loss", "--no-use-kl-loss", "--hf-checkpoint",
                     "--ref-load", "--load", "--save", "--tensor-model-parallel-size", "--context-parallel-size",
                     "--algorithm", "--advantage-estimator", "--kl-loss-type", "--kl-loss-coef", "--custom-module",
                     "--max-tokens-per-micro-batch", "--teacher-url", "--rollout-batch-size", "--dry-run"):
        assert expected in flags, expected
    # --rollout-engine shows the engine registry's kinds (and '...' for those of --custom-module files),
    # and its help is the field's docstring from the rollout's own section (stacx/rollout/sections.py).
    engine = next(action for action in parser._actions if "--rollout-engine" in action.option_strings)
    shown = engine.metavar.strip("{}").split(",")
    assert shown[0] == "auto" and shown[-1] == "..." and {"cpu", "http", "sglang"} <= set(shown)
    assert shown[1:-1] == engine_kind_names(discover=False) and engine.choices is None
    assert engine.help.startswith("Engine kind: 'cpu'")


def test_flags_fill_the_run_config_with_typed_values():
    cfg = _parse(["--algorithm", "grpo", "--hf-checkpoint", "ckpt", "--ref-load", "ref", "--tensor-model-parallel-size",
                  "2", "--context-parallel-size", "2", "--use-kl-loss", "--kl-loss-type", "low_var_kl",
                  "--kl-loss-coef", "0.01", "--custom-module", "a.py", "--custom-module", "b", "--lr", "3e-4",
                  "--no-tensorboard", "--no-plots", "--max-tokens-per-micro-batch", "512", "--teacher-url", "http://t:1",
                  "--algorithm-param", "my_temperature=0.3", "--algorithm-param", "my_flag=true"])
    assert cfg.train.algorithm == "grpo" and "name" not in cfg.algorithm.to_dict()
    assert (cfg.model.hf_checkpoint, cfg.model.ref_load) == ("ckpt", "ref")
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size) == (2, 2)
    assert cfg.algorithm.use_kl_loss is True and cfg.algorithm.kl_loss_coef == 0.01
    assert cfg.algorithm.kl_loss_type == "low_var_kl"
    assert cfg.train.custom_module == ("a.py", "b")
    assert cfg.optim.lr == 3e-4 and cfg.logging.tensorboard is False and cfg.logging.plots is False
    assert cfg.train.max_tokens_per_micro_batch == 512 and cfg.teacher.teacher_url == "http://t:1"
    assert cfg.algorithm.custom_hyperparameters() == {"my_temperature": 0.3, "my_flag": True}
    # Nothing given: exactly the RunConfig defaults.
    assert _parse([]).to_dict() == RunConfig().to_dict()


def test_config_file_with_algorithm_section_and_flags_overriding_it(tmp_path):
    path = _write(tmp_path, """
model: {hf_checkpoint: from_file}
rollout:
  n_samples_per_prompt: 8
lr: 0.001                      # flat keys work too
train: {algorithm: grpo}
algorithm:
  clip_ratio_high: 0.28
  pg_temperature: 0.5          # custom hyperparameter: reaches the kernels as config.pg_temperature
""")
    cfg = _parse(["--config", path, "--lr", "0.5", "--n-samples-per-prompt", "2"])
    assert cfg.model.hf_checkpoint == "from_file"
    assert cfg.optim.lr == 0.5 and cfg.rollout.n_samples_per_prompt == 2  # flags win
    assert cfg.algorithm.clip_ratio_high == 0.28 and cfg.algorithm.clip_ratio_low == 0.2
    assert cfg.algorithm.pg_temperature == 0.5 and cfg.train.algorithm == "grpo"
    # --algorithm overrides the file's train.algorithm.
    cfg = _parse(["--config", path, "--algorithm", "rloo"])
    assert cfg.train.algorithm == "rloo"
    assert cfg.algorithm.pg_temperature == 0.5
    # A flag for a known algorithm field overrides the file's value; --clip-ratio then fills low/high
    # only where the file did not set them.
    cfg = _parse(["--config", path, "--clip-ratio", "0.1"])
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.1, 0.28)


def test_unknown_keys_flags_and_bad_values_are_named(tmp_path, capsys):
    bad = _write(tmp_path, "model: {hf_checkpoint: x}\ntensor_model_paralel_size: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'tensor_model_paralel_size' in .*run.yaml; did you mean "
                                          r"tensor_model_parallel_size"):
        _parse(["--config", bad])
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.lr' in .*run.yaml"):
        _parse(["--config", _write(tmp_path, "rollout: {lr: 1}\n")])
    with pytest.raises(ConfigError, match=r"--config .*missing.yaml: no such file"):
        _parse(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        _parse(["--config", _write(tmp_path, "- 1\n- 2\n")])
    with pytest.raises(ConfigError, match=r"--algorithm-param 'oops': expected NAME=VALUE"):
        _parse(["--algorithm-param", "oops"])
    with pytest.raises(ConfigError, match=r"'lr' has its own flag --lr"):
        _parse(["--algorithm-param", "lr=1"])
    # The recipe has one field, train.algorithm: algorithm.name is refused naming it, in a file or a flag.
    with pytest.raises(ConfigError, match=r"algorithm.name in .*run.yaml: .*one place, train.algorithm; write "
                                          r"`train: \{algorithm: rloo\}` \(flag --algorithm rloo\)"):
        _parse(["--config", _write(tmp_path, "train: {algorithm: grpo}\nalgorithm: {name: rloo}\n")])
    with pytest.raises(ConfigError, match=r"--algorithm-param 'name=rloo': the recipe is train.algorithm; pass --algorithm rloo"):
        _parse(["--algorithm-param", "name=rloo"])
    for argv, named in ((["train", "--tensor-model-paralel-size", "2"], "--tensor-model-paralel-size"),
                        (["train", "--num-steps", "ten"], "--num-steps")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert named in capsys.readouterr().err


def test_dry_run_prints_recipe_role_graph_and_placement_without_starting_workers(tmp_path, capsys, tiny_flags):
    import ray

    path = _write(tmp_path, "train: {algorithm: ppo}\ndata_parallel_size: 2\n")
    assert main(["train", "--config", path, "--tensor-model-parallel-size", "2", "--dry-run", *tiny_flags]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recipe ppo:")
    assert "pool actor: actor, critic" in out and "inject order: critic -> actor" in out
    # A pool of tp * dp = 4 bundles; the TP=2 actor and the TP=2 critic each fill it with dp=2.
    assert "pool actor: 4 bundle(s)" in out
    assert "actor: tp=2 cp=1 dp=2 -> 4 rank(s)" in out and "critic: tp=2 cp=1 dp=2 -> 4 rank(s)" in out
    assert "runs on: a local Ray cluster" in out and "tensor_model_parallel_size: 2" in out
    assert not ray.is_initialized()
    # --use-critic selects ppo, --advantage-estimator picks the estimator's recipe.
    assert main(["train", "--advantage-estimator", "rloo", "--dry-run", *tiny_flags]) == 0
    assert capsys.readouterr().out.startswith("recipe rloo:")
    assert main(["train", "--algorithm", "nope", "--dry-run"]) == 2
    assert "--algorithm 'nope' is not a known recipe" in capsys.readouterr().err


def test_custom_module_registers_before_the_recipe_is_resolved(capsys, tiny_flags):
    example = os.path.join(REPO, "examples", "custom_algorithm", "my_algo.py")
    assert main(["train", "--custom-module", example, "--advantage-estimator", "rank_centered", "--algorithm",
                 "grpo", "--dry-run", *tiny_flags]) == 0
    assert "recipe grpo" in capsys.readouterr().out
    assert main(["train", "--custom-module", "no_such_module_xyz", "--dry-run"]) == 2
    assert "--custom-module 'no_such_module_xyz'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_teacher_url(tiny_flags):
    """A teacher server on the tiny checkpoint: the preflight checks a configured teacher answers."""
    import torch

    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer

    checkpoint = tiny_flags[tiny_flags.index("--hf-checkpoint") + 1]
    engine = CpuEngine.from_hf_checkpoint(checkpoint, params_dtype=torch.float32, seed=0)
    with EngineHttpServer(engine, model_path=checkpoint) as server:
        yield server.url


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "examples", "configs", "*.yaml"))))
def test_example_configs_resolve(path, capsys, tiny_flags, tiny_teacher_url, tmp_path):
    # The files' checkpoints and teacher are the demo's; tiny ones stand in (flags override the file).
    teacher = ["--teacher-url", tiny_teacher_url] if "teacher_url" in open(path).read() else []
    assert main(["train", "--config", path, "--dry-run", *tiny_flags, *teacher, "--save", str(tmp_path / "save")]) == 0
    family = os.path.splitext(os.path.basename(path))[0]
    assert capsys.readouterr().out.startswith(f"recipe {family}:")


# `python -m stacx.train` is `stacx train`: every launch of tests/launch/test_custom_code_on_every_rank.py's
# `run_stacx_train` without a custom folder (the Ray runs there and in test_design_doc_examples.py) and the chaos run
# of test_fault_tolerance.py start `python -m stacx.train` with `stacx train`'s flags and train with them, and the
# torchrun runs start every rank so. (Session 10: its own `python -m stacx.train --dry-run` interpreter, a second
# import of the whole stack for one line of output, was removed.)


def test_torchrun_detection_and_ray_address_in_dry_run(capsys, monkeypatch, tiny_flags):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main(["train", "--algorithm", "sft", "--dry-run", *tiny_flags]) == 0
    assert "runs on: Ray cluster at 10.0.0.1:6379" in capsys.readouterr().out
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert main(["train", "--algorithm", "sft", "--dry-run", *tiny_flags]) == 0
    assert "runs on: torchrun SPMD, world size 4" in capsys.readouterr().out


def test_cli_lists_train_and_demo():
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"train", "demo", "recipes", "serve"} <= set(choices)


def test_flag_prefixes_are_not_accepted(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--lr-warm", "5", "--dry-run"])
    assert "--lr-warm" in capsys.readouterr().err


def test_under_torchrun_a_refused_config_is_printed_once_and_ends_torchruns_summary(tmp_path, capsys):
    import json

    from stacx.launch.commands.train import report_config_error

    message = "stacx train: --rollout-batch-size must be 1 or more"
    for rank in ("0", "1"):
        error_file = tmp_path / f"error_{rank}.json"
        report_config_error(message, {"RANK": rank, "TORCHELASTIC_ERROR_FILE": str(error_file)})
        # torchrun's failure summary shows extraInfo.py_callstack as the rank's "traceback".
        assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == message
    assert capsys.readouterr().err.count(message) == 1
    report_config_error(message, {})  # a plain `stacx train`
    assert capsys.readouterr().err.strip() == message
