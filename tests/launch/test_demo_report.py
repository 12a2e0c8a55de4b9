"""The demo's overview plot: held-out accuracy (the demo's headline metric) first, then the training curves."""

from __future__ import annotations

import json

import pytest

from stacx.launch.demo.report import PANELS, draw_demo_figure, heldout_accuracy_bars, write_demo_plot

PHASE_RESULTS = [
    {"phase": "sft", "metric": "held-out accuracy", "before": 0.0, "after": 0.41, "seconds": 1.0, "extra": {}},
    {"phase": "grpo", "metric": "held-out accuracy", "before": 0.41, "after": 0.63, "seconds": 1.0, "extra": {}},
    {"phase": "opd", "metric": "reverse KL(student || teacher) per token", "before": 3.4, "after": 0.6, "seconds": 1.0,
     "extra": {"student_accuracy_before": 0.02, "student_accuracy_after": 0.22, "teacher_accuracy": 0.63}},
]


def _write_metrics(out_dir, num_steps: int = 4) -> None:
    for phase in ("sft", "grpo", "opd"):
        (out_dir / phase).mkdir()
        rows = [{"step": s, "policy/loss": 3.0 - s, "rollout/reward_mean": 0.1 * s, "policy/kl_loss": 0.01 * s}
                for s in range(num_steps)]
        (out_dir / phase / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_heldout_accuracy_bars_follow_the_models_in_training_order():
    assert heldout_accuracy_bars(PHASE_RESULTS) == [
        ("initial", 0.0), ("after SFT", 0.41), ("after GRPO", 0.63),
        ("student\ninitial", 0.02), ("student\nafter OPD", 0.22)]
    assert heldout_accuracy_bars(PHASE_RESULTS[:1]) == [("initial", 0.0), ("after SFT", 0.41)]


def test_overview_draws_heldout_accuracy_first_then_one_panel_per_curve(tmp_path):
    _write_metrics(tmp_path)
    figure = draw_demo_figure(str(tmp_path), ["sft", "grpo", "opd"], PHASE_RESULTS)
    accuracy_axes, *curve_axes = figure.axes
    assert "held-out accuracy" in accuracy_axes.get_title().lower()
    heights = [patch.get_height() for patch in accuracy_axes.patches]
    assert heights == pytest.approx([0.0, 0.41, 0.63, 0.02, 0.22])
    assert [axis.get_title() for axis in curve_axes] == [title for _, _, title, _ in PANELS]
    assert list(curve_axes[0].get_lines()[0].get_ydata()) == [3.0, 2.0, 1.0, 0.0]

    path = write_demo_plot(str(tmp_path), ["sft"], PHASE_RESULTS[:1], task="sorting")  # one curve panel still works
    assert path.endswith("plots/demo.png") and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_overview_has_a_title_and_every_axis_a_y_label(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    _write_metrics(out)
    figure = draw_demo_figure(str(out), ["sft", "grpo", "opd"], PHASE_RESULTS, task="sorting")
    assert figure._suptitle.get_text() == "stacx demo: SFT -> GRPO -> on-policy distillation on task 'sorting' (demo)"
    labels = [axis.get_ylabel() for axis in figure.axes]
    assert labels == ["fraction of prompts solved"] + [unit for _, _, _, unit in PANELS]
    assert all(labels)
