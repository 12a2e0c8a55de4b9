"""Sync vs asynchronous GRPO on the demo's task, without a cost model: held-out accuracy and wall time.

    python bench/async_rollout/demo_task.py [--seeds 0 1 2] [--out bench/results/async_demo_task.json]

The demo's SFT phase runs once (seed 0); then, for each seed, the demo's GRPO phase (40 steps x 16
prompts x 8 samples, the CPU engine as a `stacx serve` child) runs twice from that SFT model: once
with `--rollout-mode sync`, once with `--rollout-mode async --max-staleness 1`. Each run's held-out
greedy accuracy (128 prompts, measured with transformers as the demo does) and its wall time are
printed with the async/sync ratios, and a figure (accuracy per seed and mode, wall time) is written
next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MODES = {"sync": {"rollout_mode": "sync"}, "async K=1": {"rollout_mode": "async", "max_staleness": 1}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "async_demo_task.json"))
    args = parser.parse_args(argv)

    from bench.demo_grpo_arms import run_demo_grpo_arms

    start_accuracy, runs = run_demo_grpo_arms(MODES, args.seeds, work_prefix="stacx-async-demo-")

    summary = {}
    for mode in MODES:
        mine = [run for run in runs if run["mode"] == mode]
        summary[mode] = {"accuracy_mean": statistics.mean(r["accuracy"] for r in mine),
                         "accuracy_spread": max(r["accuracy"] for r in mine) - min(r["accuracy"] for r in mine),
                         "seconds_mean": statistics.mean(r["seconds"] for r in mine)}
    ratio = summary["async K=1"]["seconds_mean"] / summary["sync"]["seconds_mean"]
    print(f"\nsync:      accuracy {summary['sync']['accuracy_mean']:.3f} (spread {summary['sync']['accuracy_spread']:.3f}),"
          f" {summary['sync']['seconds_mean']:.1f} s per run")
    print(f"async K=1: accuracy {summary['async K=1']['accuracy_mean']:.3f} (spread "
          f"{summary['async K=1']['accuracy_spread']:.3f}), {summary['async K=1']['seconds_mean']:.1f} s per run "
          f"({ratio:.2f}x sync's wall time)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {"benchmark": "async_demo_task", "sft_accuracy": start_accuracy, "runs": runs, "summary": summary,
              "async_wall_time_ratio": ratio}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    figure_path = os.path.splitext(args.out)[0] + ".png"
    draw(result, figure_path)
    print(f"wrote {args.out} and {figure_path}")
    return 0



def draw(result: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    seeds = sorted({run["seed"] for run in result["runs"]})
    width = 0.38
    for offset, mode in ((-width / 2, "sync"), (width / 2, "async K=1")):
        values = [next(r for r in result["runs"] if r["seed"] == s and r["mode"] == mode) for s in seeds]
        left.bar([s + offset for s in range(len(seeds))], [v["accuracy"] for v in values], width, label=mode)
        right.bar([s + offset for s in range(len(seeds))], [v["seconds"] for v in values], width, label=mode)
    left.axhline(result["sft_accuracy"], color="grey", linestyle="--", linewidth=1, label="SFT start")
    for axes, label in ((left, "held-out accuracy (greedy)"), (right, "GRPO wall time (s)")):
        axes.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        axes.set_ylabel(label)
        axes.grid(alpha=0.3, axis="y")
        axes.legend(fontsize="small", loc="lower right")
    figure.suptitle("demo task, 40 GRPO steps: sync vs async (max staleness 1), no cost model")
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
