"""A mixture-of-experts run's expert load in its outputs: a summary per step, a heat map over the run,
and per-expert series only on request.

stacx.models.moe.expert_load_metrics reports every step, under the role's prefix (`policy/moe/...`):

    moe/max_imbalance, moe/mean_imbalance   max / mean tokens over the experts, worst and mean layer
    moe/dropped_tokens                       token slots the routers dropped (only when some were)
    moe/layer{i}/imbalance, moe/layer{i}/expert{e}_tokens   per layer and expert

The per-layer keys grow as layers x experts (6,000+ a step at 48 layers x 128 experts), too many for a
plot, TensorBoard or a JSONL row to be read. With --log-expert-load summary (the default) the driver's
MetricsLogger keeps them out of every sink and adds them into a heat map instead:

    plots/expert_load.png   per role: layers (rows) x experts (columns), each cell the expert's share of
                            its layer's token slots over the steps this process logged (1 / num_experts
                            everywhere is perfectly balanced)

--log-expert-load per-expert logs the per-layer keys as well, as series of their own.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

EXPERT_LOAD_CHOICES = ("summary", "per-expert")
"""Values of --log-expert-load (LoggingSection.log_expert_load)."""
EXPERT_LOAD_PLOT_FILE = "expert_load.png"
"""The heat map's file name under plots/."""

PER_LAYER_KEY = re.compile(r"^(?P<group>(?:.+/)?moe)/layer(?P<layer>\d+)/(?P<leaf>[^/]+)$")
"""A per-layer MoE metric: `<prefix>moe/layer{i}/<leaf>`."""
EXPERT_TOKENS_LEAF = re.compile(r"^expert(?P<expert>\d+)_tokens$")


def _number(value: Any) -> float | None:
    """A plain float of a number or a one-element tensor; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    try:
        return float(item()) if callable(item) else None
    except (TypeError, ValueError, RuntimeError):
        return None


class ExpertLoadHeatMap:
    """Adds up each layer's tokens per expert over the run (`take`, every row) and draws them (`draw`)."""

    def __init__(self, *, per_expert_series: bool = False):
        self.per_expert_series = per_expert_series
        """Keep the per-layer keys in the rows (--log-expert-load per-expert)."""
        self.tokens: dict[str, dict[tuple[int, int], float]] = {}
        """Per metric group ('policy/moe'): {(layer, expert): token slots summed over the steps taken}."""

    def take(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """`metrics` without its per-layer MoE keys (unless per_expert_series), their token counts added up."""
        kept: dict[str, Any] = {}
        for key, value in metrics.items():
            match = PER_LAYER_KEY.match(key)
            if match is None:
                kept[key] = value
                continue
            expert = EXPERT_TOKENS_LEAF.match(match["leaf"])
            number = _number(value)
            if expert is not None and number is not None:
                grid = self.tokens.setdefault(match["group"], {})
                cell = (int(match["layer"]), int(expert["expert"]))
                grid[cell] = grid.get(cell, 0.0) + number
            if self.per_expert_series:
                kept[key] = value
        return kept

    def shares(self, group: str) -> tuple[list[int], list[list[float]]]:
        """(layers, [layer][expert] share of the layer's token slots) of `group`; a layer with no tokens is all 0."""
        grid = self.tokens[group]
        layers = sorted({layer for layer, _ in grid})
        num_experts = 1 + max(expert for _, expert in grid)
        rows = []
        for layer in layers:
            counts = [grid.get((layer, expert), 0.0) for expert in range(num_experts)]
            total = sum(counts)
            rows.append([count / total if total > 0 else 0.0 for count in counts])
        return layers, rows

    def draw(self, *, title: str | None = None):
        """A Figure with one heat map per group (layers x experts, share of the layer's tokens), or None
        when no expert load was logged."""
        if not self.tokens:
            return None
        # Imported here, as in stacx.trainer.metrics: only a run that writes plots pays for matplotlib.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        groups = sorted(self.tokens)
        shapes = [self.shares(group) for group in groups]
        tallest = max(len(layers) for layers, _ in shapes)
        figure = Figure(figsize=(8, (1.5 + min(12.0, 0.25 * tallest + 1.5)) * len(groups)), dpi=100)
        FigureCanvasAgg(figure)
        axes_list = figure.subplots(len(groups), 1, squeeze=False)[:, 0]
        for axes, group, (layers, rows) in zip(axes_list, groups, shapes):
            image = axes.imshow(rows, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
            figure.colorbar(image, ax=axes, label="share of the layer's tokens")
            axes.set_xlabel("expert")
            axes.set_ylabel("layer")
            if len(layers) <= 32:  # deeper models: matplotlib's own ticks (row index)
                axes.set_yticks(range(len(layers)), [str(layer) for layer in layers])
            balanced = 1.0 / len(rows[0])
            axes.set_title(f"{group}: token share per expert over the run (balanced: {balanced:.3g} each)",
                           fontsize="medium")
        if title:
            figure.suptitle(title, fontsize="medium")
        figure.tight_layout()
        return figure


__all__ = ["EXPERT_LOAD_CHOICES", "EXPERT_LOAD_PLOT_FILE", "ExpertLoadHeatMap", "PER_LAYER_KEY"]
