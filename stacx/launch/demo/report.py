"""The demo's overview plot (held-out accuracy of every model, then each phase's training curve) and
final table, from the phases' results and metrics.jsonl files."""

from __future__ import annotations

import json
import os

# (phase, metric name in metrics.jsonl, title, y-axis label) per panel: what each phase optimizes, plus its KL.
PANELS = (
    ("sft", "policy/loss", "SFT: cross-entropy loss", "nats per token"),
    ("grpo", "rollout/reward_mean", "GRPO: mean reward (exact match)", "mean reward of the rollouts"),
    ("grpo", "policy/kl_loss", "GRPO: KL(policy || SFT model)", "KL per token"),
    ("opd", "policy/loss", "OPD: distillation loss (reverse KL)", "reverse KL per token"),
)
PHASE_NAMES = {"sft": "SFT", "grpo": "GRPO", "opd": "on-policy distillation"}


def read_series(path: str, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name` in a metrics.jsonl file; empty when the file is missing."""
    steps, values = [], []
    if not os.path.isfile(path):
        return steps, values
    with open(path) as handle:
        for line in handle:
            row = json.loads(line)
            if name in row:
                steps.append(int(row["step"]))
                values.append(float(row[name]))
    return steps, values


# (phase, where the number is in the phase's result, bar label): the headline metric, greedy exact-match
# accuracy on the held-out prompts, of every model the demo trains, in the order they are trained.
# "before"/"after" are PhaseResult fields; other names are keys of its `extra`.
HELDOUT_ACCURACY_BARS = (
    ("sft", "before", "initial"),
    ("sft", "after", "after SFT"),
    ("grpo", "after", "after GRPO"),
    ("opd", "student_accuracy_before", "student\ninitial"),
    ("opd", "student_accuracy_after", "student\nafter OPD"),
)


def heldout_accuracy_bars(phase_results: list[dict], spec=HELDOUT_ACCURACY_BARS) -> list[tuple[str, float]]:
    """[(label, held-out accuracy)] for the `spec` entries (HELDOUT_ACCURACY_BARS' form) from the
    summary's phase results (`dataclasses.asdict(PhaseResult)`); bars of phases that did not run are left out."""
    by_phase = {result["phase"]: result for result in phase_results}
    bars = []
    for phase, field, label in spec:
        result = by_phase.get(phase)
        if result is None:
            continue
        value = result[field] if field in ("before", "after") else result.get("extra", {}).get(field)
        if value is not None:
            bars.append((label, float(value)))
    return bars


def demo_title(out_dir: str, phases: list[str], task: str | None = None) -> str:
    """The overview's title: the phases in order, the task and the output folder's name."""
    steps = " -> ".join(PHASE_NAMES.get(phase, phase) for phase in phases)
    where = os.path.basename(os.path.normpath(out_dir))
    return f"stacx demo: {steps}" + (f" on task '{task}'" if task else "") + f" ({where})"


def draw_demo_figure(out_dir: str, phases: list[str], phase_results: list[dict] = (), *, task: str | None = None,
                     panels=PANELS, bars_spec=HELDOUT_ACCURACY_BARS,
                     bars_title: str = "Held-out accuracy (greedy exact match)"):
    """The overview Figure (Agg canvas, no pyplot state) under `demo_title`: first the held-out
    accuracy bars of `bars_spec` (when `phase_results` has them), then one panel per `panels` entry
    (PANELS' form) of a phase in `phases`, metric against step, each axis labelled."""
    # matplotlib only when the demo draws: importing it costs start-up time the other commands need not pay
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bars = heldout_accuracy_bars(list(phase_results), bars_spec)
    panels = [p for p in panels if p[0] in phases]
    num_axes = len(panels) + bool(bars)
    figure = Figure(figsize=(4 * num_axes, 3.6))
    FigureCanvasAgg(figure)
    axes_list = list(figure.subplots(1, num_axes, squeeze=False)[0])
    if bars:
        axis = axes_list.pop(0)
        labels, values = zip(*bars)
        colors = ["tab:green" if not label.startswith("student") else "tab:purple" for label in labels]
        drawn = axis.bar(range(len(bars)), values, color=colors)
        axis.bar_label(drawn, fmt="%.2f", fontsize=8)
        axis.set_xticks(range(len(bars)), labels, fontsize=7)
        axis.set_ylim(0, 1.1)
        axis.set_title(bars_title, fontsize=9, fontweight="bold")
        axis.set_ylabel("fraction of prompts solved", fontsize=8)
        axis.grid(alpha=0.3, axis="y")
    for axis, (phase, name, label, unit) in zip(axes_list, panels):
        steps, values = read_series(os.path.join(out_dir, phase, "metrics.jsonl"), name)
        axis.plot(steps, values, marker=".", linewidth=1)
        axis.set_title(label, fontsize=9)
        axis.set_xlabel("step")
        axis.set_ylabel(unit, fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle(demo_title(out_dir, phases, task), fontsize=11)
    figure.tight_layout()
    return figure


def write_demo_plot(out_dir: str, phases: list[str], phase_results: list[dict] = (), *, task: str | None = None,
                    **figure_options) -> str:
    """out_dir/plots/demo.png: `draw_demo_figure` (`figure_options`: its panels and bars); returns its path."""
    path = os.path.join(out_dir, "plots", "demo.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    draw_demo_figure(out_dir, phases, phase_results, task=task, **figure_options).savefig(path, dpi=100)
    return path


def format_table(summary: dict) -> str:
    """The final table: one row per phase, its metric before and after."""
    rows = [("phase", "metric", "before", "after", "seconds")]
    for phase in summary["phases"]:
        rows.append((phase["phase"], phase["metric"], f"{phase['before']:.3f}", f"{phase['after']:.3f}",
                     f"{phase['seconds']:.0f}"))
    return format_rows(rows)


def format_rows(rows: list[tuple[str, ...]]) -> str:
    """Text columns padded to their widest cell, a rule under the first row (the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
