"""What the PNGs draw beyond the families: every other metric (other.png, axes by scale), equal
series once with both names, the run and recipe in every title; and what the progress bar calls
its columns."""

from __future__ import annotations

import pytest
import io

from stacx.trainer.metrics import (OTHER_PLOT, SCALE_GROUP_RATIO, MetricsLogger, draw_family_figure, group_by_scale,
                                   headline_label, headline_metric, plan_family_plot)


def _custom_history(num_steps: int = 10) -> list[dict]:
    """A specialization's own metrics beside the usual ones: an NLL ~2, a weight ~0.01, a grad norm ~30, a count."""
    return [{"step": s, "policy/loss": 2.0 - 0.1 * s, "policy/weighted_nll": 2.5 - 0.1 * s,
             "policy/mean_weight": 0.01 + 0.001 * s, "policy/grad_norm": 30.0 + s, "policy/num_pairs": 8.0 + s,
             "policy/weights_nonfinite": 0.0} for s in range(num_steps)]


def _log_all(logger: MetricsLogger, history: list[dict]) -> None:
    for row in history:
        logger.log(row["step"], {k: v for k, v in row.items() if k != "step"})


@pytest.mark.slow
def test_metrics_of_no_family_are_drawn_in_other_png_with_axes_by_scale(tmp_path):
    with MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress_bar=False, plots=False) as logger:
        _log_all(logger, _custom_history())
        written = {path.rsplit("/", 1)[-1]: plan for path, plan in logger.write_plots().items()}
    assert sorted(written) == ["loss.png", "other.png"]
    other = written["other.png"]
    # Scales 0.02, 2.5 and 39 are each over SCALE_GROUP_RATIO apart: three value axes, the count below.
    assert other.value_panels == (("policy/mean_weight",), ("policy/weighted_nll",), ("policy/grad_norm",))
    assert other.count_keys == ("policy/num_pairs",) and other.zero_keys == ("policy/weights_nonfinite",)
    assert "policy/loss" not in other.drawn_keys  # in loss.png already
    figure = draw_family_figure(logger.history, other)
    labels = [[line.get_label() for line in axes.get_lines() if not line.get_label().startswith("_")]
              for axes in figure.axes]
    assert labels == [["policy/mean_weight"], ["policy/weighted_nll"], ["policy/grad_norm"], ["policy/num_pairs"]]
    assert [axes.get_ylabel() for axes in figure.axes] == ["value", "value", "value", "count"]
    assert (tmp_path / "plots" / "other.png").stat().st_size > 0


def test_scale_groups_keep_series_within_the_ratio_together():
    series = {name: [(0, scale)] for name, scale in (("a", 1.0), ("b", 5.0), ("c", 11.0), ("d", -0.5), ("e", 300.0))}
    assert SCALE_GROUP_RATIO == 10.0
    assert group_by_scale(series, list(series)) == [("a", "b", "d"), ("c",), ("e",)]


def test_a_series_equal_to_another_is_drawn_once_with_both_names():
    history = [{"step": s, "policy/loss": 1.0 / (s + 1), "policy/dpo_loss": 1.0 / (s + 1), "policy/kl_loss": 0.1 * s}
               for s in range(4)]
    plan = plan_family_plot(history, "loss")
    assert plan.identical == (("policy/dpo_loss", "policy/loss"),)
    lines = draw_family_figure(history, plan).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["policy/dpo_loss = policy/loss", "policy/kl_loss"]
    legend = [text.get_text() for text in draw_family_figure(history, plan).axes[0].get_legend().get_texts()]
    assert legend == ["policy/dpo_loss = policy/loss", "policy/kl_loss"]
    # Equal at some steps only: two lines.
    history[2]["policy/dpo_loss"] = 0.0
    assert plan_family_plot(history, "loss").identical == ()


def test_a_panel_of_series_drawn_in_another_panel_is_left_out(recwarn):
    """A PPO run's `critic/lr` equalled `actor/lr` at every step: drawn once in the actor's panel (both names in its
    legend), it left the critic's own panel an empty box with an empty legend (and matplotlib's warning)."""
    history = [{"step": s, "actor/lr": 1e-4, "actor/entropy": 2.9 - 0.01 * s, "critic/lr": 1e-4,
                "rollout/response_length_mean": 5.0 + s} for s in range(3)]
    plan = plan_family_plot(history, OTHER_PLOT)
    assert plan.identical == (("actor/lr", "critic/lr"),)
    assert ("critic/lr",) not in plan.value_panels and "critic/lr" not in plan.value_keys, plan.value_panels
    figure = draw_family_figure(history, plan)
    assert all(axes.get_lines() for axes in figure.axes)
    assert "actor/lr = critic/lr" in [line.get_label() for axes in figure.axes for line in axes.get_lines()]
    assert not [w for w in recwarn if "No artists with labels" in str(w.message)]


def test_every_png_title_names_the_run_and_the_recipe(tmp_path):
    out = tmp_path / "grpo_math"
    with MetricsLogger(out, total_steps=10, tensorboard=False, progress_bar=False, plots=False,
                       recipe="grpo") as logger:
        _log_all(logger, [{**row, "rollout/reward_mean": 0.1 * row["step"]} for row in _custom_history()])
    assert logger.plot_title == "grpo_math · recipe grpo"
    for family in ("reward", "loss", OTHER_PLOT):  # write_plots draws each PNG with draw_plot
        title = logger.draw_plot(plan_family_plot(logger.history, family)).axes[0].get_title()
        assert title.startswith("grpo_math · recipe grpo\n"), (family, title)
    named = MetricsLogger(tmp_path / "x", total_steps=1, tensorboard=False, progress_bar=False, plots=False,
                          recipe="dpo", run_name="ablation 3")
    named.close()
    assert named.plot_title == "ablation 3 · recipe dpo"


def test_the_progress_bar_names_a_headline_that_is_not_the_rollout_reward():
    dpo_row = {"policy/dpo_loss": 0.6, "policy/chosen_reward": 0.2, "policy/rejected_reward": -0.1,
               "policy/reward_margin": 0.3, "policy/reward_accuracy": 0.75, "policy/loss": 0.6}
    key, value = headline_metric(dpo_row, "reward")
    assert (headline_label(key, "reward"), value) == ("reward margin", 0.3)
    assert headline_label(headline_metric(dpo_row, "loss")[0], "loss") == "loss"
    assert headline_label("rollout/reward_mean", "reward") == "reward"  # the rollouts' reward keeps the plain name
    assert headline_label("policy/chosen_reward", "reward") == "chosen reward"


def test_the_progress_bar_of_a_dpo_run_says_reward_margin(tmp_path):
    bar = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress_file=bar, plots=False) as logger:
        logger.log(0, {"policy/dpo_loss": 0.6, "policy/chosen_reward": 0.2, "policy/rejected_reward": -0.1,
                       "policy/reward_margin": 0.3, "policy/reward_accuracy": 0.75, "policy/loss": 0.6})
        logger.log(1, {"rollout/reward_mean": 0.5, "policy/loss": 0.4})  # a rollout recipe's row
    text = bar.getvalue()
    assert "step 1/2 |" in text and "reward margin 0.3, loss 0.6" in text
    assert "step 2/2 |" in text and "reward 0.5, loss 0.4" in text

