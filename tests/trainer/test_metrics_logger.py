"""The metrics logger: JSONL rows, TensorBoard scalars, PNG plots, the progress bar, resume and wandb."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest
import torch

from stacx.trainer.metrics import (
    LEGEND_WIDTH,
    MetricsLogger,
    MetricsLoggerError,
    draw_family_figure,
    headline_metric,
    is_count_metric,
    plan_family_plot,
)


def _metrics(step: int) -> dict:
    return {
        "rollout/reward_mean": 0.1 * step,
        "train/pg_loss": torch.tensor(2.0 - 0.25 * step),
        "train/kl_loss": 0.01 * step,
        "train/grad_norm": 1.5,
        "train/clipped": True,
        "note": "text",
    }


def _read_tensorboard(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.mark.slow
def test_logger_writes_jsonl_tensorboard_plots_and_a_progress_bar(tmp_path):
    bar = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=4, progress_file=bar) as logger:
        for step in range(3):
            logger.log(step, _metrics(step))

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert rows[2]["train/pg_loss"] == pytest.approx(1.5) and rows[2]["train/clipped"] == 1
    assert rows[1]["note"] == "text" and rows[1]["time_s"] >= 0

    scalars = _read_tensorboard(tmp_path / "tensorboard")
    assert "note" not in scalars
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [0, 1, 2]
    assert [v for _, v in scalars["train/pg_loss"]] == pytest.approx([2.0, 1.75, 1.5])

    plots = {path.name: path for path in (tmp_path / "plots").iterdir()}
    assert sorted(plots) == ["kl.png", "loss.png", "other.png", "reward.png"]  # no eval/* metric: no eval.png
    from matplotlib.image import imread

    for path in plots.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = imread(path).shape[:2]
        assert (width, height) == (700 + 100 * LEGEND_WIDTH, 400)  # the legends beside the axes

    text = bar.getvalue()
    assert "step 3/4" in text and "reward 0.2, pg loss 1.5" in text and "ETA" in text  # the loss named by its metric


@pytest.mark.slow
def test_plot_families_pick_metrics_by_word(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress_bar=False)
    logger.log(0, _metrics(0))
    logger.log(1, _metrics(1))
    written = {path.rsplit("/", 1)[-1]: plan.drawn_keys for path, plan in logger.write_plots().items()}
    logger.close()
    assert written == {
        "reward.png": ("rollout/reward_mean",),
        "loss.png": ("train/kl_loss", "train/pg_loss"),
        "kl.png": ("train/kl_loss",),
        "other.png": ("train/clipped", "train/grad_norm"),  # in no family, still drawn
    }


def _grpo_like_history(num_steps: int = 6) -> list[dict]:
    """Rows shaped like a GRPO run's: losses ~0.01-3, a token count ~190-760, an error count that stays 0."""
    rows = []
    for step in range(num_steps):
        row = {"step": step, "time_s": 0.1 * step, "rollout/reward_mean": 0.1 * step, "rollout/reward_errors": 0.0,
               "rollout/num_samples": 16.0, "policy/loss": 3.0 / (step + 1), "policy/kl_loss": 0.01 * step,
               "policy/num_loss_tokens": 190.0 + 100 * step, "note": "text"}
        if step % 2:
            row.update({"eval/pass@1": 0.1 * step, "eval/mean_reward": 0.1 * step, "eval/reward_errors": 0.0})
        rows.append(row)
    return rows


def test_counts_get_their_own_axes_and_always_zero_series_are_not_drawn():
    history = _grpo_like_history()
    loss = plan_family_plot(history, "loss")
    assert loss.value_keys == ("policy/kl_loss", "policy/loss")
    assert loss.count_keys == ("policy/num_loss_tokens",) and loss.zero_keys == ()
    reward = plan_family_plot(history, "reward")
    assert reward.drawn_keys == ("eval/mean_reward", "rollout/reward_mean")
    assert reward.zero_keys == ("eval/reward_errors", "rollout/reward_errors")
    assert plan_family_plot(history, "eval").value_keys == ("eval/mean_reward", "eval/pass@1")

    # What the figure really draws: losses on the top axes, the token count on the axes below.
    figure = draw_family_figure(history, loss)
    top, bottom = figure.axes
    assert [line.get_label() for line in top.get_lines()] == ["policy/kl_loss", "policy/loss"]
    assert [line.get_label() for line in bottom.get_lines()] == ["policy/num_loss_tokens"]
    assert top.get_ylim()[1] < 10 < 190 < bottom.get_ylim()[1]  # the loss axis is not stretched by the count
    reward_figure = draw_family_figure(history, reward)
    assert len(reward_figure.axes) == 1
    assert "rollout/reward_errors" not in [line.get_label() for line in reward_figure.axes[0].get_lines()]
    assert any("rollout/reward_errors" in text.get_text() for text in reward_figure.texts)  # named in the note
    eval_lines = draw_family_figure(history, plan_family_plot(history, "eval")).axes[0].get_lines()
    assert [list(line.get_xdata()) for line in eval_lines] == [[1, 3, 5]]  # only the evaluated steps
    assert [line.get_label() for line in eval_lines] == ["eval/mean_reward = eval/pass@1"]  # equal: drawn once


def test_a_count_is_recognised_by_its_name_and_never_the_progress_bar_headline():
    assert is_count_metric("policy/num_loss_tokens") and is_count_metric("rollout/reward_errors")
    assert not is_count_metric("policy/loss") and not is_count_metric("rollout/reward_mean")
    assert headline_metric({"policy/num_loss_tokens": 400.0, "policy/pg_loss": 0.5}, "loss") == ("policy/pg_loss", 0.5)


def test_a_family_that_is_zero_at_every_step_writes_no_png(tmp_path):
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress_bar=False) as logger:
        for step in range(2):
            logger.log(step, {"policy/loss": 1.0 / (step + 1), "rollout/reward_errors": 0.0})
    assert sorted(path.name for path in (tmp_path / "plots").iterdir()) == ["loss.png"]


def test_the_run_configs_plots_switch_reaches_the_drivers_logger(tmp_path):
    """`--no-plots` (logging.plots): the run's logger writes metrics.jsonl and no plots/ folder."""
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.factory import build_metrics_logger

    for plots in (True, False):
        out = tmp_path / str(plots)
        run_config = RunConfig.from_dict({"out": str(out), "plots": plots, "tensorboard": False, "progress_bar": False})
        with build_metrics_logger(run_config, "sft") as logger:
            logger.log(0, {"policy/loss": 1.0})
        assert (out / "metrics.jsonl").is_file() and (out / "plots").is_dir() == plots


def test_resume_keeps_rows_before_the_checkpoint_and_drops_the_rest(tmp_path):
    with MetricsLogger(tmp_path, total_steps=5, tensorboard=False, progress_bar=False, plots=False) as logger:
        for step in range(4):  # the run died after logging step 3; its last checkpoint was after step 1
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, total_steps=5, start_step=2, tensorboard=False, progress_bar=False) as logger:
        assert [row["step"] for row in logger.history] == [0, 1]
        for step in range(2, 5):
            logger.log(step, {"loss": 10.0 + step})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["loss"]) for row in rows] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    # A fresh run (start_step 0) in the same folder starts a fresh file.
    with MetricsLogger(tmp_path, total_steps=1, tensorboard=False, progress_bar=False, plots=False) as logger:
        logger.log(0, {"loss": 5.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_bad_metric_and_options_are_named(tmp_path):
    with pytest.raises(MetricsLoggerError, match="total_steps"):
        MetricsLogger(tmp_path, total_steps=0)
    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress_bar=False, plots=False)
    with pytest.raises(MetricsLoggerError, match=r"metric 'train/logits': .* with 6 elements"):
        logger.log(0, {"train/logits": torch.zeros(2, 3)})
    with pytest.raises(MetricsLoggerError, match=r"'step' is reserved"):
        logger.log(0, {"step": 1})
    logger.close()


def test_wandb_is_required_when_asked_for_and_used_when_present(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(MetricsLoggerError, match=r"--wandb-project 'proj'.*not installed"):
        MetricsLogger(tmp_path, total_steps=1, wandb_project="proj", tensorboard=False, progress_bar=False)

    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", step, dict(values)))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw["project"], kw["config"])) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path, total_steps=1, wandb_project="proj", run_config={"lr": 0.1}, tensorboard=False,
                       progress_bar=False, plots=False) as logger:
        logger.log(0, {"loss": 1.0, "note": "x"})
    assert calls == [("init", "proj", {"lr": 0.1}), ("log", 0, {"loss": 1.0}), ("finish",)]


def test_headline_metric_prefers_exact_then_suffix_then_family_member():
    assert headline_metric({"a/pg_loss": 1.0, "loss": 2.0}, "loss") == ("loss", 2.0)
    assert headline_metric({"a/pg_loss": 1.0, "train/loss": 3.0}, "loss") == ("train/loss", 3.0)
    assert headline_metric({"rollout/raw_reward": 0.5}, "reward") == ("rollout/raw_reward", 0.5)
    assert headline_metric({"x": 1.0}, "reward") is None


def _write_rollouts(path, steps) -> None:
    path.write_text("".join(json.dumps({"step": step, "response_text": f"answer {step}"}) + "\n" for step in steps))


def test_a_new_run_in_a_used_folder_starts_every_output_fresh(tmp_path, caplog):
    with MetricsLogger(tmp_path, total_steps=3, progress_bar=False) as logger:  # the earlier run
        for step in range(3):
            logger.log(step, {"policy/loss": 10.0 + step})
    _write_rollouts(tmp_path / "rollouts.jsonl", range(3))
    (tmp_path / "checkpoints").mkdir()  # not a sink of the logger: left alone
    assert (tmp_path / "plots" / "loss.png").is_file() and (tmp_path / "tensorboard").is_dir()

    with caplog.at_level("WARNING"):
        logger = MetricsLogger(tmp_path, total_steps=1, progress_bar=False, plots=False)
    assert sorted(logger.replaced_outputs) == ["metrics.jsonl", "plots/", "rollouts.jsonl", "tensorboard/"]
    assert "starts them fresh" in caplog.text and "rollouts.jsonl" in caplog.text
    assert not (tmp_path / "rollouts.jsonl").exists() and not (tmp_path / "plots").exists()
    with logger:
        logger.log(0, {"policy/loss": 1.0})
    assert [json.loads(line)["policy/loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1.0]
    assert _read_tensorboard(tmp_path / "tensorboard")["policy/loss"] == [(0, 1.0)]  # not the earlier run's 3 events
    assert (tmp_path / "checkpoints").is_dir()


def test_resuming_keeps_the_rollout_dumps_of_earlier_steps_only(tmp_path):
    _write_rollouts(tmp_path / "rollouts.jsonl", range(4))
    with MetricsLogger(tmp_path, total_steps=5, start_step=2, tensorboard=False, progress_bar=False, plots=False) as logger:
        assert logger.replaced_outputs == []
    steps = [json.loads(line)["step"] for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
