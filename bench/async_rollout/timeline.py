"""What the engine and the trainer do, when, in a real sync and a real async GRPO run: the timeline figure
of docs/training-loop.md.

    python bench/async_rollout/timeline.py [--steps 8] [--out docs/images/async_timeline.png]

The demo's GRPO phase (16 prompts x 8 samples per step, the CPU engine as a `stacx serve` child, one
trainer rank on Ray), from the demo's random initial model, run once with `--rollout-mode sync` and once
with `--rollout-mode async --max-staleness 1`. The driver's event timestamps are recorded in-process,
without a cost model: every engine call (start, answer, number of requests: the engine lane shows the
requests in flight), and the loop's phases (waiting for the batch, forward fields + optimizer step,
weight update). Writes the figure and a JSON of the events next to it; prints each run's seconds per
step over the steps after the first two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MODES = {"sync": {"rollout_mode": "sync"}, "async K=1": {"rollout_mode": "async", "max_staleness": 1}}
WARMUP_STEPS = 2
"""Steps left out of the seconds per step (Ray workers and the engine warming up)."""
PHASES = {"batch": "collect_batch", "train": "train_role", "fields": "fill_forward_fields",
          "update": "push_policy_weights"}
"""Event name -> the StacxTrainer method whose calls it times."""


class Recorder:
    """(name, start, end, size) events in seconds since `origin` (time.monotonic)."""

    def __init__(self):
        self.origin = time.monotonic()
        self.events: list[dict] = []

    def timed(self, name: str, function, size=lambda args: 0):
        def wrapper(*args, **kwargs):
            start = time.monotonic()
            try:
                return function(*args, **kwargs)
            finally:
                self.events.append({"name": name, "start": start - self.origin, "end": time.monotonic() - self.origin,
                                    "size": size(args)})
        return wrapper


def run_mode(settings, work: str, paths: dict, name: str, values: dict, steps: int, max_new_tokens: int) -> list[dict]:
    from stacx.launch.demo.phases import demo_run_config
    from stacx.tasks.data import resolve_builtin_data
    from stacx.trainer.config.checks import fit_response_length_to_context
    from stacx.trainer.factory import create_trainer

    config = fit_response_length_to_context(resolve_builtin_data(demo_run_config(settings, work, name, {
        "algorithm": {"name": "grpo"}, "hf_checkpoint": paths["init"], "prompt_data": paths["train"],
        "rollout_batch_size": settings.grpo.prompts_per_step, "n_samples_per_prompt": settings.grpo.samples_per_prompt,
        "rollout_max_response_len": max_new_tokens, "lr": settings.grpo.lr, "num_steps": steps, **values})))
    trainer = create_trainer(config)
    recorder = Recorder()
    engine = trainer.rollout.engine
    engine.generate = recorder.timed("engine", engine.generate, size=lambda args: len(args[0]))
    for event, method in PHASES.items():
        setattr(trainer, method, recorder.timed(event, getattr(trainer, method)))
    step_ends = []
    log = trainer.log
    trainer.log = lambda *args, **kwargs: (step_ends.append(time.monotonic() - recorder.origin), log(*args, **kwargs))
    trainer.run()
    recorder.events.append({"name": "step_ends", "times": step_ends})
    return recorder.events


def draw(runs: dict[str, list[dict]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 2.2 * len(runs) + 0.6), dpi=110)
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(len(runs), 1, sharex=True)
    colours = {"batch": "#bbbbbb", "fields": "#9ecae1", "train": "#2171b5", "update": "#d62728"}
    labels = {"batch": "trainer waits for its batch", "fields": "forward fields (pi_old, ref)",
              "train": "optimizer step", "update": "weight update"}
    for axes, (mode, events) in zip(axes_list, runs.items()):
        step_ends = next(e["times"] for e in events if e["name"] == "step_ends")
        start = step_ends[WARMUP_STEPS - 1]
        calls = [e for e in events if e["name"] == "engine" and e["end"] > start]
        changes = sorted([(max(c["start"], start) - start, c["size"]) for c in calls]
                         + [(c["end"] - start, -c["size"]) for c in calls])
        times, in_flight, level = [0.0], [0], 0
        for moment, delta in changes:
            times.append(moment)
            in_flight.append(level)
            level += delta
            times.append(moment)
            in_flight.append(level)
        peak = max(in_flight + [1])
        axes.fill_between(times, [1.2 + 0.9 * n / peak for n in in_flight], 1.2, color="#31a354", alpha=0.7,
                          linewidth=0, label="engine: requests in flight")
        for event in events:
            if event["name"] in colours and event["end"] > start:
                axes.barh(0.5, event["end"] - max(event["start"], start), left=max(event["start"], start) - start,
                          height=0.6, color=colours[event["name"]], label=labels[event["name"]])
        for end in step_ends[WARMUP_STEPS:]:
            axes.axvline(end - start, color="black", linewidth=0.6, linestyle=":")
        per_step = (step_ends[-1] - start) / (len(step_ends) - WARMUP_STEPS)
        axes.set_yticks([0.5, 1.65], ["trainer", "engine"])
        axes.set_ylim(0, 2.25)
        axes.set_title(f"{mode}: {per_step:.2f} s per step (dotted: a step ends)", fontsize="medium", loc="left")
    handles, names = axes_list[0].get_legend_handles_labels()
    for axes in axes_list[1:]:
        more_handles, more_names = axes.get_legend_handles_labels()
        handles, names = handles + more_handles, names + more_names
    unique = dict(zip(names, handles))
    figure.legend(unique.values(), unique.keys(), loc="lower center", ncol=5, fontsize="small")
    axes_list[-1].set_xlabel("seconds since the end of step 2")
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "images", "async_timeline.png"))
    args = parser.parse_args(argv)

    from stacx.launch.demo.pipeline import DemoSettings, _prepare
    from stacx.tasks import get_task
    from stacx.trainer.cluster.ray.connect import connect_ray

    settings = DemoSettings(progress_bar=False)
    max_new_tokens = get_task(settings.task).max_answer_chars + 1
    work = tempfile.mkdtemp(prefix="stacx-async-timeline-")
    paths = _prepare(settings, work)
    connection = connect_ray(None, log_to_driver=False)
    runs = {}
    try:
        for mode, values in MODES.items():
            name = "grpo_" + mode.replace(" ", "").replace("=", "")
            runs[mode] = run_mode(settings, work, paths, name, values, args.steps, max_new_tokens)
            step_ends = next(e["times"] for e in runs[mode] if e["name"] == "step_ends")
            per_step = (step_ends[-1] - step_ends[WARMUP_STEPS - 1]) / (len(step_ends) - WARMUP_STEPS)
            print(f"{mode:9s}: {per_step:.2f} s per step after step {WARMUP_STEPS}", flush=True)
    finally:
        connection.shutdown()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as handle:
        json.dump(runs, handle, indent=1)
    draw(runs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
