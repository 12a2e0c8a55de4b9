"""Plots draw a smoothed curve over the faint raw line, so a noisy loss or reward shows its trend."""

from __future__ import annotations

import math
import random

import pytest

from stacx.trainer.metrics import (RAW_LINE_ALPHA, SMOOTHING_MIN_POINTS, MetricsLogger, draw_family_figure,
                                          ema, plan_family_plot)


def test_ema_is_debiased_and_follows_the_formula():
    assert ema([5.0, 5.0, 5.0]) == pytest.approx([5.0, 5.0, 5.0])  # no pull towards 0 at the start
    w = 0.5
    m0, m1 = 0.5 * 2.0, 0.5 * (0.5 * 2.0) + 0.5 * 4.0
    assert ema([2.0, 4.0], w) == pytest.approx([m0 / (1 - w), m1 / (1 - w ** 2)])
    with pytest.raises(ValueError, match="smoothing weight must be in"):
        ema([1.0], 1.0)


def _noisy_history(num_steps: int) -> list[dict]:
    rng = random.Random(0)
    return [{"step": s, "policy/loss": 2.0 * math.exp(-s / 20) + rng.uniform(-0.4, 0.4),
             "policy/num_loss_tokens": 200 + 10 * s} for s in range(num_steps)]


def test_a_long_series_is_drawn_raw_and_faint_under_its_moving_average_in_the_same_colour():
    history = _noisy_history(60)
    figure = draw_family_figure(history, plan_family_plot(history, "loss"))
    raw, smooth = figure.axes[0].get_lines()
    assert raw.get_alpha() == RAW_LINE_ALPHA and raw.get_label().startswith("_")  # not in the legend
    assert smooth.get_label() == "policy/loss" and smooth.get_color() == raw.get_color()
    values = [row["policy/loss"] for row in history]
    assert list(raw.get_ydata()) == values
    assert list(smooth.get_ydata()) == pytest.approx(ema(values))
    roughness = lambda ys: sum(abs(b - a) for a, b in zip(ys, ys[1:]))  # noqa: E731
    assert roughness(list(smooth.get_ydata())) < roughness(values) / 2
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()] == ["policy/loss"]
    assert [line.get_label() for line in figure.axes[1].get_lines()] == ["policy/num_loss_tokens"]  # counts: raw


def test_a_short_series_is_drawn_raw_only():
    history = _noisy_history(SMOOTHING_MIN_POINTS - 1)
    lines = draw_family_figure(history, plan_family_plot(history, "loss")).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["policy/loss"]


def test_the_logger_writes_the_smoothed_png(tmp_path):
    with MetricsLogger(tmp_path, total_steps=60, tensorboard=False, progress_bar=False) as metrics_logger:
        for row in _noisy_history(60):
            metrics_logger.log(row["step"], {k: v for k, v in row.items() if k != "step"})
    assert (tmp_path / "plots" / "loss.png").stat().st_size > 0


def test_a_series_of_whole_numbers_is_drawn_exactly_not_smoothed():
    history = [{"step": s, "rollout/weight_version": float(s), "rollout/dynamic_rounds": 1 + s % 3}
               for s in range(2 * SMOOTHING_MIN_POINTS)]
    plan = plan_family_plot(history, "other")
    lines = draw_family_figure(history, plan).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["rollout/dynamic_rounds", "rollout/weight_version"]
    assert [list(line.get_ydata()) for line in lines] == [[row[key] for row in history] for key in
                                                         ("rollout/dynamic_rounds", "rollout/weight_version")]
