"""The driver's metrics sinks: JSONL, TensorBoard, wandb (when installed and asked for), PNG plots
and a progress bar with step, reward, loss and ETA.

    with MetricsLogger(out_dir, total_steps=100, wandb_project=None) as logger:
        for step in range(100):
            logger.log(step, {"rollout/reward_mean": 0.4, "train/loss": 1.2, "train/kl": 0.01})

Files under `out_dir`:
    metrics.jsonl           one JSON object per step: {"step": s, "time_s": t, <metric>: value, ...}
    tensorboard/            event files (one scalar series per metric)
    plots/{reward,loss,kl,eval}.png   every metric whose name has that word, against the step:
                            values on the top axes, counts (num_*, *_errors, ...) on their own
                            axes below, series that are 0 at every step not drawn (named in a note);
                            a value series of SMOOTHING_MIN_POINTS or more is drawn faint (raw) under
                            its exponential moving average (`ema`) in the same colour (one of whole
                            numbers only, e.g. a weight version, exactly as it is); series equal
                            at every step drawn once, all their names in one legend entry ("a = b")
    plots/other.png         every metric of none of those families (a plugin's own metrics, grad norm,
                            lr, timings, ...) the same way, its values on axes grouped by metric group
                            ('rollout', 'policy/moe', ...) and scale (SCALE_GROUP_RATIO)
    plots/expert_load.png   a mixture-of-experts model's layers x experts token share
                            (stacx.trainer.expert_load_plot; its per-layer keys stay out of the other
                            sinks unless expert_load="per-expert")
    Each plot's title names the run (`run_name`, default out_dir's folder) and its `recipe`; legends
    sit beside the axes, at most MAX_SERIES_PER_PANEL series an axes; when a rollout is trained in
    several optimizer steps, dotted lines mark where each rollout's steps begin (`rollout_boundaries`).

The progress bar shows "step k/N" once k steps are done ("rollout k/N" when each rollout is trained
in several optimizer steps, said once above the bar), with the headline reward and loss of the
last row (`headline_metric`), each named by what it is (`headline_label`: "reward" for the
rollouts' mean reward, else the metric's own name, e.g. DPO's "reward margin"). While it is drawn,
warnings of a process that configured no logging are written above it (TqdmLogHandler).

A run's outputs in `out_dir` are consistent with the run that last wrote them:
- a new run (`start_step=0`) into a folder an earlier run wrote starts fresh files for all of
  them: metrics.jsonl, rollouts.jsonl (the rollout dumps), tensorboard/ and plots/ are removed
  first (a warning names them); nothing else in the folder is touched (checkpoints under --save
  have their own guard, see stacx.trainer.checkpoint.check_save_folder);
- resuming (`start_step=N`) keeps the rows of steps < N in metrics.jsonl and rollouts.jsonl and
  drops later ones, which the interrupted run logged after its last checkpoint and the resumed
  run will log again; TensorBoard drops its events of steps >= N (`purge_step`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TextIO

from tqdm import tqdm

from stacx.trainer.expert_load_plot import EXPERT_LOAD_CHOICES, EXPERT_LOAD_PLOT_FILE, ExpertLoadHeatMap

PLOT_FAMILIES = ("reward", "loss", "kl", "eval")
"""Each family gets one PNG with every metric whose name has a word starting with it."""

COUNT_PREFIXES = ("num_",)
COUNT_SUFFIXES = ("_count", "_errors", "_tokens", "_samples", "_sequences")
"""A metric is a count (drawn on its own axes, never next to a loss of another scale) when the last
part of its name starts or ends with one of these, e.g. policy/num_loss_tokens, rollout/reward_errors."""

SMOOTHING_WEIGHT = 0.8
"""w of the plotted moving average s_t = w * s_(t-1) + (1 - w) * x_t (debiased, see `ema`): about the
last 1 / (1 - w) = 5 points weigh in."""
SMOOTHING_MIN_POINTS = 8
"""Shorter series are drawn raw only: a handful of points is readable as it is."""
RAW_LINE_ALPHA = 0.3
"""Opacity of the raw line under its smoothed curve."""

logger = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"
"""Rollout dumps (stacx.rollout.evaluation.RolloutDumper), one JSON row per sample with its "step"."""
RUN_OUTPUT_FOLDERS = ("tensorboard", "plots")
"""Folders under out_dir that hold one run's sinks; removed when a new run starts there."""


def reset_run_outputs(out_dir: str | os.PathLike, start_step: int) -> list[str]:
    """Make out_dir's run outputs consistent for a run starting at `start_step` (module docstring);
    returns the names of what a new run removed. metrics.jsonl is handled by MetricsLogger itself."""
    out_dir = Path(out_dir)
    if start_step > 0:
        keep_rows_before(out_dir / ROLLOUTS_FILE, start_step)
        return []
    removed = []
    for name in ("metrics.jsonl", ROLLOUTS_FILE):
        if (out_dir / name).is_file():
            (out_dir / name).unlink()
            removed.append(name)
    for name in RUN_OUTPUT_FOLDERS:
        if (out_dir / name).is_dir():
            shutil.rmtree(out_dir / name)
            removed.append(f"{name}/")
    if removed:
        logger.warning("%s held an earlier run's %s; this new run (not resuming with --load) starts them fresh",
                       out_dir, ", ".join(removed))
    return removed


def keep_rows_before(path: Path, start_step: int) -> list[dict[str, Any]]:
    """Rewrite the JSONL file `path` (atomically) with only its rows of steps < start_step; returns them."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("step", math.inf) < start_step:
                kept.append(row)
    temporary = path.with_suffix(".jsonl.tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
    os.replace(temporary, path)
    return kept


class MetricsLoggerError(ValueError):
    """A logging option or metric value is wrong; the message names it."""


def _scalar(key: str, value: Any) -> float | int | str | None:
    """A JSON-able scalar from a Python number, bool, string, None or a one-element tensor/array."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    count = numel() if callable(numel) else numel
    if count == 1 and hasattr(value, "item"):
        return value.item()
    raise MetricsLoggerError(f"metric {key!r}: expected a number or a one-element tensor, got {type(value).__name__}"
                             + (f" with {count} elements" if count is not None else ""))


NONFINITE_METRICS_KEY = "nonfinite_metrics"
"""Row key listing the metrics of a step that were NaN or inf (absent when all were finite)."""


def _json_number(value: Any) -> Any:
    """NaN, inf and -inf as the strings "nan", "inf", "-inf" (valid JSON); anything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def metric_family_members(keys: list[str], family: str) -> list[str]:
    """Metric names with a word (split on non-alphanumerics) starting with `family`, e.g. 'train/pg_loss' for 'loss'."""
    return [key for key in keys if any(word.startswith(family) for word in re.split(r"[^a-z0-9]+", key.lower()))]


def headline_metric(metrics: Mapping[str, Any], family: str) -> tuple[str, float] | None:
    """The metric that best stands for `family` in the progress bar: the key `family` itself, else
    one ending in '/family' or 'family_mean', else the first name of that family that is not a count,
    one whose last part starts with the word (DPO's 'policy/reward_margin') before one that only
    has it later ('policy/chosen_reward')."""
    numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key in numeric:
        if key == family or key.endswith(f"/{family}") or key.endswith(f"{family}_mean"):
            return key, numeric[key]
    members = [key for key in metric_family_members(list(numeric), family) if not is_count_metric(key)]
    members.sort(key=lambda key: not key.rsplit("/", 1)[-1].lower().startswith(family))  # stable: keeps the order
    return (members[0], numeric[members[0]]) if members else None


def headline_label(key: str, family: str) -> str:
    """The progress bar's name for the headline `key` of `family`: the family word when the metric is
    the family itself ('loss', 'policy/loss', 'rollout/reward_mean'), else the metric's own short
    name ('policy/reward_margin' -> 'reward margin'), so a column never passes for what it is not."""
    leaf = key.rsplit("/", 1)[-1]
    return family if leaf in (family, f"{family}_mean") else leaf.replace("_", " ")


def is_count_metric(key: str) -> bool:
    """Whether `key` names a count (COUNT_PREFIXES / COUNT_SUFFIXES on the part after the last '/')."""
    leaf = key.rsplit("/", 1)[-1].lower()
    return leaf.startswith(COUNT_PREFIXES) or leaf.endswith(COUNT_SUFFIXES)


OTHER_PLOT = "other"
"""Name of the PNG with every metric that is in no family of PLOT_FAMILIES (a plugin's or a
specialization's own metrics, timings, ...), its values split over axes by scale."""
SCALE_GROUP_RATIO = 10.0
"""In the `other` plot, value series share axes while the largest |value| of each is within this
factor of the smallest one's: a series never looks flat because another is 100x larger."""


@dataclass(frozen=True)
class FamilyPlot:
    """What one PNG draws: each of `value_panels` on its own axes from the top (one panel for a
    family, panels by scale for `other`), `count_keys` on the axes below (absent when empty),
    `zero_keys`, the members that were 0 at every logged step, named in a note instead of drawn as
    a flat line at 0, and `identical`, groups of drawn names whose series are equal at every step:
    each group is drawn once (by its first name) with all its names in the legend."""

    family: str
    value_panels: tuple[tuple[str, ...], ...]
    count_keys: tuple[str, ...]
    zero_keys: tuple[str, ...]
    identical: tuple[tuple[str, ...], ...] = ()

    @property
    def value_keys(self) -> tuple[str, ...]:
        return tuple(key for panel in self.value_panels for key in panel)

    @property
    def drawn_keys(self) -> tuple[str, ...]:
        return self.value_keys + self.count_keys

    def legend_label(self, key: str) -> str | None:
        """The legend entry of `key`: its name, the names of its identical group joined by ' = '
        (for the group's first name), or None for a later name of a group (not drawn)."""
        for group in self.identical:
            if key in group:
                return " = ".join(group) if key == group[0] else None
        return key


def plan_family_plot(history: list[Mapping[str, Any]], family: str) -> FamilyPlot:
    """Split the numeric metrics of `family` found in `history` rows into values, counts and
    always-zero; `family` OTHER_PLOT takes every metric of no family, its values split by scale."""
    series = _numeric_series(history)
    if family == OTHER_PLOT:
        in_families = {key for name in PLOT_FAMILIES for key in metric_family_members(list(series), name)}
        # The rollout step is no curve of its own: its changes are the dotted rollout boundaries.
        members = [key for key in sorted(series) if key not in in_families and key != ROLLOUT_STEP_KEY]
    else:
        members = metric_family_members(sorted(series), family)
    zero = tuple(key for key in members if all(value == 0 for _, value in series[key]))
    drawn = [key for key in members if key not in zero]
    values = [key for key in drawn if not is_count_metric(key)]
    counts = tuple(key for key in drawn if is_count_metric(key))
    if family == OTHER_PLOT:
        panels = [panel for group in group_by_prefix(values) for panel in group_by_scale(series, list(group))]
    else:
        panels = [tuple(values)] if values else []
    panels = [chunk for panel in panels for chunk in at_most(panel, MAX_SERIES_PER_PANEL)]
    identical = identical_series(series, list(values), list(counts))
    # A series equal to another is drawn once, under its group's first name: a panel holding only later names of
    # such groups (drawn in another panel) would be an empty box with an empty legend, and stays out.
    later_names = {key for group in identical for key in group[1:]}
    panels = [panel for panel in panels if not set(panel) <= later_names]
    return FamilyPlot(family=family, value_panels=tuple(panels), count_keys=counts, zero_keys=zero,
                      identical=identical)


MAX_SERIES_PER_PANEL = 6
"""A value panel with more series is cut into panels of at most this many (in name order): more lines
than that on one axes cannot be told apart, whatever their legend."""


def group_by_prefix(keys: list[str]) -> list[tuple[str, ...]]:
    """`keys` grouped by metric group, the name up to its last '/' ('policy/moe', 'rollout', '' for none),
    groups in order of first appearance: the `other` plot never draws a rollout timing beside a loss term."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rsplit("/", 1)[0] if "/" in key else "", []).append(key)
    return [tuple(group) for group in groups.values()]


def at_most(keys: tuple[str, ...], size: int) -> list[tuple[str, ...]]:
    """`keys` cut into consecutive chunks of at most `size` names."""
    return [keys[start:start + size] for start in range(0, len(keys), size)]


def group_by_scale(series: Mapping[str, list[tuple[int, float]]], keys: list[str],
                   ratio: float = SCALE_GROUP_RATIO) -> list[tuple[str, ...]]:
    """`keys` in groups of similar scale (largest finite |value|), smallest scale first: a group
    takes the next larger series while its scale is within `ratio` of the group's smallest."""
    def scale(key: str) -> float:
        return max((abs(value) for _, value in series[key] if math.isfinite(value)), default=0.0)

    groups: list[list[str]] = []
    smallest = 0.0
    for key in sorted(keys, key=scale):
        if not groups or scale(key) > ratio * smallest:
            groups.append([])
            smallest = scale(key)
        groups[-1].append(key)
    return [tuple(sorted(group)) for group in groups]


IDENTICAL_REL_TOL = 1e-6
"""Two series are drawn as one when they have the same steps and every pair of values agrees within this
relative tolerance: a total summed in another order than its one term (policy/loss beside
policy/pg_loss) differs in the last bits only, and would be drawn exactly under it."""


def _same_points(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Same steps, values equal within IDENTICAL_REL_TOL (NaN equals NaN, inf equals the same inf)."""
    if len(a) != len(b):
        return False
    for (step_a, x), (step_b, y) in zip(a, b):
        if step_a != step_b:
            return False
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return False
        elif not math.isclose(x, y, rel_tol=IDENTICAL_REL_TOL, abs_tol=1e-12):
            return False
    return True


def identical_series(series: Mapping[str, list[tuple[int, float]]], *panels: list[str]) -> tuple[tuple[str, ...], ...]:
    """Groups (2 or more names, in the given order) of the same panel whose (step, value) series are
    equal (within IDENTICAL_REL_TOL), e.g. one loss logged under two names; NaN equals NaN here."""
    groups = []
    for keys in panels:
        found: list[list[str]] = []
        for key in keys:
            group = next((group for group in found if _same_points(series[group[0]], series[key])), None)
            if group is None:
                found.append([key])
            else:
                group.append(key)
        groups += [tuple(group) for group in found if len(group) > 1]
    return tuple(groups)


def _numeric_series(history: list[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(step, value)] over the rows where it is a number (not a bool or string)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in history:
        for key, value in row.items():
            if key not in ("step", "time_s") and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((row["step"], value))
    return series


def ema(values: list[float], weight: float = SMOOTHING_WEIGHT) -> list[float]:
    """Debiased exponential moving average, as TensorBoard's smoothing:

        m_t = w * m_(t-1) + (1 - w) * x_t,  m_(-1) = 0;   s_t = m_t / (1 - w^(t+1))

    so s_0 = x_0 (no pull towards 0 at the start) and a constant series stays constant."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    smoothed, moving = [], 0.0
    for index, value in enumerate(values):
        moving = weight * moving + (1 - weight) * value
        smoothed.append(moving / (1 - weight ** (index + 1)))
    return smoothed


def _whole_numbers(values) -> bool:
    """Whether every value is a whole number (a version, a count of rounds): drawn exactly, never
    smoothed into fractions that lag behind it."""
    return all(float(value).is_integer() for value in values)


FAMILY_FIGURE_SIZE = (7, 4)
"""Inches at 100 dpi (700 x 400 pixels) of the axes; a plot grows by OTHER_PANEL_HEIGHT per value panel past
the first, and by LEGEND_WIDTH to the right, where the legends sit (outside the axes, never over the data)."""
OTHER_PANEL_HEIGHT = 2.2
LEGEND_WIDTH = 3.0

ROLLOUT_STEP_KEY = "rollout_step"
"""Row key of the rollout step an optimizer step trained on (stacx.trainer.loop.StacxTrainer.log). When a
rollout is trained in several optimizer steps (mini-batches), every plot marks where a new rollout's
steps begin with a dotted vertical line: the steps of one rollout share their samples, and a metric such
as ppo_kl climbs within a rollout and drops at the next."""


def rollout_boundaries(history: list[Mapping[str, Any]]) -> list[int]:
    """The steps at which a new rollout's optimizer steps begin, when some rollout has more than one
    (mini-batch runs); [] otherwise."""
    steps_of: dict[Any, list[int]] = {}
    for row in history:
        if ROLLOUT_STEP_KEY in row:
            steps_of.setdefault(row[ROLLOUT_STEP_KEY], []).append(row["step"])
    if not any(len(set(steps)) > 1 for steps in steps_of.values()):
        return []
    return sorted(min(steps) for steps in steps_of.values())[1:]


def is_family_total(key: str, family: str) -> bool:
    """Whether `key` is the family's total (its last part is the family word: 'policy/loss'): drawn dashed,
    so that a term equal to it at most steps (policy/pg_loss without a KL term) still shows under it."""
    return key.rsplit("/", 1)[-1] == family


def draw_family_figure(history: list[Mapping[str, Any]], plan: FamilyPlot, *, title: str | None = None):
    """A matplotlib Figure (Agg canvas, no pyplot state) for `plan`: one axes per value panel (if
    any), then the counts' (if any), sharing the step axis; the always-zero names in a footnote;
    `title` (the run and its recipe) above it all."""
    # Imported here: matplotlib costs a few tenths of a second to import, which a run with --no-plots
    # (and every torchrun rank but the driver) never needs.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = _numeric_series(history)
    boundaries = rollout_boundaries(history)
    panels = [(keys, plan.family) for keys in plan.value_panels] + ([(plan.count_keys, "count")] if plan.count_keys else [])
    heights = [3 if label != "count" else 1.6 for _, label in panels]
    width, height = FAMILY_FIGURE_SIZE
    figure = Figure(figsize=(width + LEGEND_WIDTH, height + OTHER_PANEL_HEIGHT * max(0, len(plan.value_panels) - 1)),
                    dpi=100)
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False,
                                gridspec_kw={"height_ratios": heights})[:, 0]
    for axes, (keys, label) in zip(axes_list, panels):
        # The family's total last: its dashes lie on top of a term it nearly equals, never under it.
        for key in sorted(keys, key=lambda key: is_family_total(key, plan.family)):
            legend = plan.legend_label(key)
            if legend is None:  # drawn under the first name of its identical group
                continue
            steps, values = zip(*series[key])
            style = "--" if is_family_total(key, plan.family) else "-"
            if len(values) < SMOOTHING_MIN_POINTS or label == "count" or _whole_numbers(values):  # exact, no lag
                axes.plot(steps, values, style, marker="o", markersize=2, label=legend)
                continue
            (raw,) = axes.plot(steps, values, style, alpha=RAW_LINE_ALPHA, linewidth=1, label=f"_{legend} (raw)")
            axes.plot(steps, ema(list(values)), style, color=raw.get_color(), linewidth=1.8, label=legend)
        for boundary in boundaries:
            axes.axvline(boundary - 0.5, color="grey", linestyle=":", linewidth=0.8, label="_rollout boundary")
        axes.set_ylabel(label if label == "count" or plan.family != OTHER_PLOT else "value")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    smoothed = any(len(series[key]) >= SMOOTHING_MIN_POINTS and not _whole_numbers([v for _, v in series[key]])
                   for key in plan.value_keys)
    heading = f"{plan.family} metrics per step" if plan.family == OTHER_PLOT else f"{plan.family} per step"
    heading += (" (faint: raw; solid: moving average)" if smoothed else "")
    heading += (" · dotted: a new rollout" if boundaries else "")
    axes_list[0].set_title(f"{title}\n{heading}" if title else heading, fontsize="medium")
    axes_list[-1].set_xlabel("step")
    axes_list[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if plan.zero_keys:
        figure.text(0.01, 0.01, "0 at every step (not drawn): " + ", ".join(plan.zero_keys), fontsize="x-small",
                    wrap=True)
    figure.tight_layout(rect=(0, 0.04 if plan.zero_keys else 0, 1, 1))
    return figure


class TqdmLogHandler(logging.StreamHandler):
    """Python logging's last-resort handler (warnings of a process that configured no logging) while a
    progress bar is drawn: each record is written with `tqdm.write`, above the bar, not through it."""

    def __init__(self, stream: TextIO | None = None):
        super().__init__(stream or sys.stderr)
        self.setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: a failing handler reports, never raises
            self.handleError(record)


class MetricsLogger:
    """Writes every step's metrics to all enabled sinks; `close()` (or the with-block) writes the plots."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        progress_bar: bool = True,
        progress_file: TextIO | None = None,
        plots: bool = True,
        recipe: str | None = None,
        run_name: str | None = None,
        optimizer_steps_per_rollout: int = 1,
        expert_load: str = "summary",
    ):
        """
        Args:
            out_dir: folder for metrics.jsonl, tensorboard/ and plots/ (created).
            total_steps: steps of the whole run (the progress bar's total and ETA).
            start_step: first step this process logs (> 0 when resuming; earlier JSONL rows are kept).
            tensorboard: write TensorBoard event files.
            wandb_project: log to this Weights & Biases project; requires the wandb package.
            wandb_run_name: the wandb run's display name.
            run_config: the resolved run configuration, attached to the wandb run.
            progress_bar: show the progress bar (on stderr unless progress_file is given).
            plots: write the PNG plots on close().
            recipe: the recipe's name, in every plot's title.
            run_name: the run's name in every plot's title; default: out_dir's folder name.
            optimizer_steps_per_rollout: optimizer steps (rows) of each rollout (mini-batches); above 1 the
                progress bar counts rollouts ("rollout k/N"), advancing on a rollout's last row, and says
                once how many optimizer steps each rollout has.
            expert_load: "summary" keeps the per-layer MoE keys (`moe/layer{i}/...`) out of every sink but
                the heat map (stacx.trainer.expert_load_plot); "per-expert" logs them too.
        """
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise MetricsLoggerError(f"total_steps must be an integer >= 1, got {total_steps!r}")
        if not 0 <= start_step <= total_steps:
            raise MetricsLoggerError(f"start_step must be in [0, total_steps={total_steps}], got {start_step!r}")
        if optimizer_steps_per_rollout < 1 or total_steps % optimizer_steps_per_rollout:
            raise MetricsLoggerError(f"optimizer_steps_per_rollout must be >= 1 and divide total_steps={total_steps}, "
                                     f"got {optimizer_steps_per_rollout!r}")
        if expert_load not in EXPERT_LOAD_CHOICES:
            raise MetricsLoggerError(f"expert_load (--log-expert-load) must be one of {list(EXPERT_LOAD_CHOICES)}, "
                                     f"got {expert_load!r}")
        self.per_rollout = optimizer_steps_per_rollout
        self.expert_load = ExpertLoadHeatMap(per_expert_series=expert_load == "per-expert")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self.plots_enabled = plots
        self.plot_title = " · ".join(part for part in (run_name or self.out_dir.resolve().name,
                                                     recipe and f"recipe {recipe}") if part)
        """First line of every plot's title: the run and its recipe, e.g. 'grpo_math · recipe grpo'."""
        self.replaced_outputs = reset_run_outputs(self.out_dir, start_step)
        """What a new run removed from out_dir (names), see the module docstring."""
        self.history: list[dict[str, Any]] = keep_rows_before(self.jsonl_path, start_step) if start_step else []
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._start_time = time.monotonic()
        self._tensorboard = None
        self._wandb = None
        self._bar = None
        self._saved_last_resort = None
        if tensorboard:
            # Imported here: TensorBoard is slow to import (start-up time).
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"), purge_step=start_step or None)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise MetricsLoggerError(
                    f"--wandb-project {wandb_project!r} was given but the wandb package is not installed; "
                    f"install the wandb package or drop --wandb-project"
                ) from None
            self._wandb = wandb.init(project=wandb_project, name=wandb_run_name, dir=str(self.out_dir),
                                     config=dict(run_config or {}), resume="allow")
        if progress_bar:
            unit = "rollout" if self.per_rollout > 1 else "step"
            self._bar = tqdm(
                total=total_steps // self.per_rollout, initial=start_step // self.per_rollout,
                file=progress_file or sys.stderr, dynamic_ncols=True, mininterval=0,
                bar_format=unit + " {n_fmt}/{total_fmt} |{bar}| {desc} [{elapsed}, ETA {remaining}]",
            )
            if self.per_rollout > 1:
                tqdm.write(f"stacx: {self.per_rollout} optimizer steps per rollout; the bar counts rollouts "
                           f"({total_steps // self.per_rollout} of them, {total_steps} optimizer steps)",
                           file=progress_file or sys.stderr)
            # A warning logged while the bar is drawn goes above it (tqdm.write), not into it.
            self._saved_last_resort, logging.lastResort = logging.lastResort, TqdmLogHandler(progress_file)

    def log(self, step: int, metrics: Mapping[str, Any], *, trained: bool = True) -> dict[str, Any]:
        """Record one step's metrics in every sink; returns the row written to JSONL. `trained=False`:
        a row that ends no training step (the final model's eval): the progress bar stays as it is."""
        row: dict[str, Any] = {"step": int(step), "time_s": round(time.monotonic() - self._start_time, 3)}
        metrics = self.expert_load.take(metrics)
        for key, value in metrics.items():
            if key in row or key == NONFINITE_METRICS_KEY:
                raise MetricsLoggerError(f"metric name {key!r} is reserved by the logger")
            row[key] = _scalar(key, value)
        nonfinite = [key for key, value in row.items() if isinstance(value, float) and not math.isfinite(value)]
        if nonfinite:  # named in the row; strict JSON has no NaN/inf, so the JSONL holds them as strings
            row[NONFINITE_METRICS_KEY] = nonfinite
        self._jsonl.write(json.dumps({key: _json_number(value) for key, value in row.items()}) + "\n")
        self._jsonl.flush()
        self.history.append(row)
        numeric = {k: v for k, v in row.items()
                   if k not in ("step", "time_s") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tensorboard is not None:
            for key, value in numeric.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._bar is not None and trained:
            shown = []
            for family in ("reward", "loss"):
                found = headline_metric(numeric, family)
                if found is not None:
                    shown.append(f"{headline_label(found[0], family)} {found[1]:.4g}")
            self._bar.set_description_str(", ".join(shown), refresh=False)
            if (step + 1) % self.per_rollout == 0:  # a rollout's last optimizer step
                self._bar.update(1)
            else:
                self._bar.refresh()
        return row

    def write_plots(self) -> dict[str, FamilyPlot]:
        """One PNG per family in PLOT_FAMILIES, then OTHER_PLOT, with a series to draw; returns
        {png path: what it draws}."""
        written: dict[str, FamilyPlot] = {}
        for family in PLOT_FAMILIES + (OTHER_PLOT,):
            plan = plan_family_plot(self.history, family)
            if not plan.drawn_keys:
                continue
            path = self.out_dir / "plots" / f"{family}.png"
            path.parent.mkdir(exist_ok=True)
            self.draw_plot(plan).savefig(path)
            written[str(path)] = plan
        heat_map = self.expert_load.draw(title=self.plot_title)
        if heat_map is not None:
            path = self.out_dir / "plots" / EXPERT_LOAD_PLOT_FILE
            path.parent.mkdir(exist_ok=True)
            heat_map.savefig(path)
        return written

    def draw_plot(self, plan: FamilyPlot):
        """The Figure of `plan` over the rows logged so far, titled with the run and its recipe."""
        return draw_family_figure(self.history, plan, title=self.plot_title)

    def close(self) -> None:
        """Flush and close every sink and write the plots (safe to call twice)."""
        if self._jsonl.closed:
            return
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()
            logging.lastResort = self._saved_last_resort
        if self.plots_enabled and self.history:
            self.write_plots()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["ROLLOUTS_FILE", "RUN_OUTPUT_FOLDERS", "keep_rows_before", "reset_run_outputs", "COUNT_PREFIXES",
           "COUNT_SUFFIXES", "FamilyPlot", "MetricsLogger", "MetricsLoggerError", "OTHER_PLOT", "PLOT_FAMILIES",
           "SCALE_GROUP_RATIO", "draw_family_figure", "ema", "group_by_scale", "headline_label", "headline_metric",
           "identical_series", "is_count_metric", "metric_family_members", "plan_family_plot", "IDENTICAL_REL_TOL",
           "LEGEND_WIDTH", "MAX_SERIES_PER_PANEL", "ROLLOUT_STEP_KEY", "TqdmLogHandler", "at_most", "group_by_prefix",
           "is_family_total", "rollout_boundaries"]
