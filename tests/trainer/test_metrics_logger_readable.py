"""What a user reads in a run's outputs: MoE expert load as a summary and a heat map (per-expert series on
request), legends beside the axes, the `other` plot split by metric group, a mini-batch run's progress bar
counting rollouts with boundaries in its plots, and a total drawn dashed over the term it equals."""

from __future__ import annotations

import argparse
import io
import logging

import torch

from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args
from stacx.models.moe import expert_load_metrics
from stacx.trainer.expert_load_plot import ExpertLoadHeatMap
from stacx.trainer.metrics import (MAX_SERIES_PER_PANEL, OTHER_PLOT, MetricsLogger, TqdmLogHandler, draw_family_figure,
                                   plan_family_plot, rollout_boundaries)


def _quiet_logger(tmp_path, **kwargs) -> MetricsLogger:
    return MetricsLogger(tmp_path, tensorboard=False, progress_bar=False, plots=False, **kwargs)


def test_expert_load_metrics_report_the_mean_imbalance_and_dropped_tokens_only_when_some_are():
    counts = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
    metrics = expert_load_metrics(counts, [0, 1])
    assert metrics["moe/max_imbalance"] == 1.5 and metrics["moe/mean_imbalance"] == 1.25
    assert "moe/dropped_tokens" not in expert_load_metrics(counts, [0, 1], torch.zeros(2))
    assert expert_load_metrics(counts, [0, 1], torch.tensor([0.0, 3.0]))["moe/dropped_tokens"] == 3.0


def _moe_rows(num_steps: int = 3, layers: int = 2, experts: int = 4) -> list[dict]:
    rows = []
    for step in range(num_steps):
        counts = torch.tensor([[float(1 + e + layer) for e in range(experts)] for layer in range(layers)])
        rows.append({"policy/loss": 1.0 - 0.1 * step,
                     **{f"policy/{key}": value for key, value in expert_load_metrics(counts).items()}})
    return rows


def test_moe_runs_log_a_summary_by_default_and_draw_a_layers_by_experts_heat_map(tmp_path):
    with _quiet_logger(tmp_path, total_steps=3) as logger:
        for step, row in enumerate(_moe_rows()):
            logged = logger.log(step, row)
        assert not any("/layer" in key for key in logged), logged
        assert {"policy/moe/max_imbalance", "policy/moe/mean_imbalance"} <= set(logged)
        logger.write_plots()
        layers, shares = logger.expert_load.shares("policy/moe")
    assert layers == [0, 1] and [round(share, 6) for share in shares[0]] == [0.1, 0.2, 0.3, 0.4]
    assert (tmp_path / "plots" / "expert_load.png").stat().st_size > 0
    other = plan_family_plot(logger.history, OTHER_PLOT)
    assert not any("expert" in key for key in other.drawn_keys)


def test_per_expert_series_are_logged_on_request():
    heat_map = ExpertLoadHeatMap(per_expert_series=True)
    kept = heat_map.take(_moe_rows(1)[0])
    assert "policy/moe/layer1/expert3_tokens" in kept and "policy/moe/layer0/imbalance" in kept
    assert heat_map.tokens["policy/moe"][(1, 3)] == 5.0


def test_the_log_expert_load_flag_reaches_the_logging_section():
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    assert run_config_from_args(parser.parse_args([])).logging.log_expert_load == "summary"
    args = parser.parse_args(["--log-expert-load", "per-expert"])
    assert run_config_from_args(args).logging.log_expert_load == "per-expert"


def _async_history(num_steps: int = 4) -> list[dict]:
    """An async run's own series: 11 of them, of three groups and similar scales."""
    names = ([f"rollout/staleness_{i}" for i in range(4)] + [f"async/queue_{i}" for i in range(4)]
             + ["policy/grad_norm", "policy/lr_scale", "policy/entropy_bonus"])
    return [{"step": s, **{name: 1.0 + 0.01 * s + 0.1 * i for i, name in enumerate(names)}} for s in range(num_steps)]


def test_the_other_plot_splits_panels_by_metric_group_and_keeps_legends_off_the_data():
    history = _async_history()
    plan = plan_family_plot(history, OTHER_PLOT)
    assert all(len(panel) <= MAX_SERIES_PER_PANEL for panel in plan.value_panels)
    assert all(len({key.rsplit("/", 1)[0] for key in panel}) == 1 for panel in plan.value_panels)
    assert len(plan.value_keys) == 11
    figure = draw_family_figure(history, plan)
    figure.canvas.draw()
    for axes in figure.axes:
        legend_box = axes.get_legend().get_window_extent()
        assert legend_box.x0 >= axes.get_window_extent().x1  # beside the axes, never over the lines


def test_a_total_that_equals_its_term_within_rounding_is_drawn_once_or_dashed():
    history = [{"step": s, "policy/pg_loss": 0.1 * s + 0.3, "policy/loss": (0.1 * s + 0.3) * (1 + 1e-9)}
               for s in range(4)]
    plan = plan_family_plot(history, "loss")
    assert plan.identical == (("policy/loss", "policy/pg_loss"),)
    history[1]["policy/loss"] += 0.01  # a KL term at one step: two lines, the total dashed above the term
    plan = plan_family_plot(history, "loss")
    lines = draw_family_figure(history, plan).axes[0].get_lines()
    assert [(line.get_label(), line.get_linestyle()) for line in lines] == [("policy/pg_loss", "-"), ("policy/loss", "--")]


def test_a_mini_batch_run_counts_rollouts_and_marks_their_boundaries(tmp_path):
    bar = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=12, tensorboard=False, plots=False, progress_file=bar,
                           optimizer_steps_per_rollout=4)
    try:
        assert isinstance(logging.lastResort, TqdmLogHandler)  # a warning goes above the bar, not into it
        for step in range(12):
            logger.log(step, {"rollout_step": step // 4, "policy/ppo_kl": 0.01 * (step % 4)})
    finally:
        logger.close()
    assert not isinstance(logging.lastResort, TqdmLogHandler)
    text = bar.getvalue()
    assert "4 optimizer steps per rollout" in text and "rollout 3/3" in text and "step 12/12" not in text
    assert "rollout 4/3" not in text
    assert rollout_boundaries(logger.history) == [4, 8]
    figure = draw_family_figure(logger.history, plan_family_plot(logger.history, "kl"))
    dotted = [line for line in figure.axes[0].get_lines() if line.get_label() == "_rollout boundary"]
    assert [line.get_xdata()[0] for line in dotted] == [3.5, 7.5]
    assert "rollout_step" not in plan_family_plot(logger.history, OTHER_PLOT).drawn_keys  # drawn as the boundaries


def test_one_optimizer_step_per_rollout_keeps_the_step_bar_and_no_boundaries(tmp_path):
    bar = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=3, tensorboard=False, plots=False, progress_file=bar) as logger:
        for step in range(3):
            logger.log(step, {"rollout_step": step, "policy/loss": 1.0})
    assert "step 3/3" in bar.getvalue() and "per rollout" not in bar.getvalue()
    assert rollout_boundaries(logger.history) == []



def test_a_family_with_many_series_is_cut_into_panels_of_a_few():
    """A family keeps its groups together (reward.png compares the rollouts' reward with eval's), in panels
    of at most MAX_SERIES_PER_PANEL series."""
    history = [{"step": s, **{f"rollout/group{i}_loss": 0.01 * i + s for i in range(8)}} for s in range(3)]
    panels = plan_family_plot(history, "loss").value_panels
    assert [len(panel) for panel in panels] == [MAX_SERIES_PER_PANEL, 8 - MAX_SERIES_PER_PANEL]
