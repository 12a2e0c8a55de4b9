"""`stacx train` says where its outputs went, and warns before a run whose trained model would be discarded."""

from __future__ import annotations

from stacx.launch.cli import main
from stacx.tasks import write_tiny_checkpoint
from stacx.trainer.metrics import MetricsLogger
from stacx.trainer.config.run import RunConfig
from stacx.trainer.run_summary import describe_run_outputs, unsaved_model_warning


def _run_config(tmp_path, **values) -> RunConfig:
    return RunConfig.from_dict({"out": str(tmp_path / "out"), "num_steps": 2, **values}, source="test")


def _write_outputs(out: str) -> None:
    with MetricsLogger(out, total_steps=2, progress_bar=False) as logger:
        for step in range(2):
            logger.log(step, {"policy/loss": 1.0 / (step + 1), "rollout/reward_mean": 0.5 * step})


def test_unsaved_model_is_warned_about_unless_save_or_export_is_set(tmp_path):
    assert "--export-hf DIR" in unsaved_model_warning(_run_config(tmp_path))
    assert unsaved_model_warning(_run_config(tmp_path, export_hf=str(tmp_path / "hf"))) is None
    assert unsaved_model_warning(_run_config(tmp_path, save=str(tmp_path / "ckpt"))) is None


def test_summary_lists_what_is_on_disk_and_the_models_fate(tmp_path):
    run_config = _run_config(tmp_path)
    out = run_config.logging.out
    _write_outputs(out)
    summary = describe_run_outputs(run_config, seconds=12.3)
    assert summary.splitlines()[0] == f"stacx train: finished 2 step(s) in 12 s; outputs in {out}/"
    assert f"{out}/metrics.jsonl" in summary and "loss.png, reward.png" in summary
    assert f"tensorboard --logdir {out}/tensorboard" in summary
    assert "rollouts" not in summary  # this run dumped none
    assert "the trained model was NOT saved" in summary

    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text("{}")
    saved = describe_run_outputs(_run_config(tmp_path, export_hf=str(export)))
    assert f"stacx eval --hf-checkpoint {export}" in saved and "NOT saved" not in saved


def test_stacx_train_warns_first_and_prints_the_summary_last(tmp_path, monkeypatch, capsys):
    import stacx.trainer

    checkpoint = write_tiny_checkpoint(str(tmp_path / "ckpt"), "sorting", seed=0)
    out = str(tmp_path / "out")
    events = []

    def fake_training(run_config):
        events.append("warning printed" if "warning: neither --save" in capsys.readouterr().err else "no warning")
        _write_outputs(run_config.logging.out)
        return {}

    monkeypatch.setattr(stacx.trainer, "run_training", fake_training)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--algorithm", "sft", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:sorting",
                 "--num-steps", "2", "--out", out, "--no-progress-bar"]) == 0
    assert events == ["warning printed"]
    printed = capsys.readouterr().out
    assert f"outputs in {out}/" in printed and "NOT saved" in printed

    monkeypatch.setenv("RANK", "1")  # torchrun's other ranks stay quiet
    assert main(["train", "--algorithm", "sft", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:sorting",
                 "--num-steps", "2", "--out", out, "--no-progress-bar"]) == 0
    assert events[-1] == "no warning" and "outputs in" not in capsys.readouterr().out
