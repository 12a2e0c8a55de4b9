"""The demo's overview plot and final table, from the phases' metrics.jsonl files."""

from __future__ import annotations

import json
import os

# (phase, metric name in metrics.jsonl, label) per panel: what each phase optimizes, plus its KL.
PANELS = (
    ("sft", "policy/loss", "SFT: cross-entropy loss"),
    ("grpo", "rollout/reward_mean", "GRPO: mean reward (exact match)"),
    ("grpo", "policy/kl_loss", "GRPO: KL(policy || SFT model)"),
    ("opd", "policy/loss", "OPD: distillation loss (reverse KL)"),
)


def read_series(path: str, name: str) -> tuple[list[int], list[float]]:
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


def write_demo_plot(out_dir: str, phases: list[str]) -> str | None:
    """out_dir/plots/demo.png: one panel per PANELS entry, metric against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if p[0] in phases]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for axis, (phase, name, label) in zip(axes, panels):
        steps, values = read_series(os.path.join(out_dir, phase, "metrics.jsonl"), name)
        axis.plot(steps, values, marker=".", linewidth=1)
        axis.set_title(label, fontsize=9)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path = os.path.join(out_dir, "plots", "demo.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def format_table(summary: dict) -> str:
    """The final table: one row per phase, its metric before and after."""
    rows = [("phase", "metric", "before", "after", "seconds")]
    for phase in summary["phases"]:
        rows.append((phase["phase"], phase["metric"], f"{phase['before']:.3f}", f"{phase['after']:.3f}",
                     f"{phase['seconds']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
