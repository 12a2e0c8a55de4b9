"""Asynchronous rollout vs the synchronous loop, on a cost-model engine with long-tailed response lengths.

    python bench/async_rollout/run.py [--steps 12 --warmup 2 --groups 8 --samples 4 --train-step-s 0.4,0.8,1.6]

The engine (`engine_model.py`) sleeps per decode step and per prefill token and batches every
running request into each decode step; response lengths are log-normal with p99 = 10x the median.
The trainer stand-in sleeps a fixed time per optimizer step. Modes (`modes.py`), one process, in
turn: sync, async K=0 (must train exactly sync's batches), async K=1 and K=2, each with the
in-flight groups drained or (partial rollout) interrupted and continued at every weight update;
every async mode runs Stacx's `AsyncRolloutScheduler`. One regime per `--train-step-s` value
(engine-bound below the sync rollout time, trainer-bound above), each with its own sync run.
Prints samples/s and its ratio to sync,
trainer and engine idle fractions, the stall and idle decode capacity per weight update, and the
staleness histogram; writes bench/results/async_rollout.json. Targets: async K=1 >= 1.6x sync
samples/s; partial rollout halves the engine's idle time at weight updates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_model import CostModel, Workload  # noqa: E402
from modes import RunShape, run_async, run_sync  # noqa: E402

MODES = ("sync", "k0", "k1", "k1p", "k2", "k2p")
"""k<K>: async with the in-flight groups drained at updates; k<K>p: with partial rollout."""


TARGETS = {
    "k1_samples_per_s_vs_sync": (1.6, True),
    "k1_partial_over_drain_update_idle": (0.5, False),
    "k2_partial_over_drain_update_idle": (0.5, False),
}
"""The issue's targets: (bound, whether the value must be at least the bound rather than at most)."""


def run_mode(mode: str, cost: CostModel, workload: Workload, shape: RunShape):
    if mode == "sync":
        return run_sync(cost, workload, shape)
    return run_async(cost, workload, shape, max_staleness=int(mode[1]), partial=mode.endswith("p"))


def run_regime(modes: list[str], cost: CostModel, workload: Workload, shape: RunShape) -> dict:
    """Every mode at one train-step time; prints the table and the checks against the targets."""
    results = [run_mode(mode, cost, workload, shape) for mode in modes]
    sync = results[0]
    print(f"\ntrain step {cost.train_step_s:.3f} s = {cost.train_step_s / max(sync.rollout_median_s, 1e-9):.2f}x "
          f"the sync rollout median ({sync.rollout_median_s:.3f} s per step)")
    print(f"{'mode':<18}{'samples/s':>10}{'vs sync':>9}{'trainer idle':>14}{'engine idle':>13}"
          f"{'update stall s':>16}{'update idle s':>15}  staleness")
    rows = []
    for result in results:
        ratio = result.samples_per_s / sync.samples_per_s
        print(f"{result.mode:<18}{result.samples_per_s:>10.1f}{ratio:>8.2f}x{result.trainer_idle_frac:>14.2f}"
              f"{result.engine_idle_frac:>13.2f}{result.update_stall_s:>16.3f}{result.update_slot_idle_s:>15.3f}"
              f"  {result.staleness_histogram}")
        rows.append(dict(result.row(), ratio_samples_per_s_vs_sync=ratio))
    by_mode = dict(zip(modes, results))
    checks = {}
    if "k0" in by_mode:
        checks["k0_trains_sync_batches"] = by_mode["k0"].batches == sync.batches
    if "k1" in by_mode:
        checks["k1_samples_per_s_vs_sync"] = by_mode["k1"].samples_per_s / sync.samples_per_s
    for k in (1, 2):
        drain, partial = by_mode.get(f"k{k}"), by_mode.get(f"k{k}p")
        if drain and partial:
            checks[f"k{k}_partial_over_drain_update_idle"] = partial.update_slot_idle_s / max(drain.update_slot_idle_s, 1e-12)
            checks[f"k{k}_partial_over_drain_update_stall"] = partial.update_stall_s / max(drain.update_stall_s, 1e-12)
    for name, value in checks.items():
        if name in TARGETS:
            bound, at_least = TARGETS[name]
            met = value >= bound if at_least else value <= bound
            verdict = f"  (target {'>=' if at_least else '<='} {bound}: {'met' if met else 'NOT met'})"
        else:
            verdict = ""
        print(f"{name}: {value if isinstance(value, bool) else round(value, 3)}{verdict}")
    return {"train_step_s": cost.train_step_s, "sync_rollout_median_s": sync.rollout_median_s, "rows": rows, "checks": checks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)} (sync always runs)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the measurement (the pipeline filling up)")
    parser.add_argument("--groups", type=int, default=8, help="prompt groups per step")
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--median-response-len", type=int, default=30)
    parser.add_argument("--p99-over-median", type=float, default=10.0)
    parser.add_argument("--max-response-len", type=int, default=480)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-step-s", type=float, default=0.002)
    parser.add_argument("--prefill-token-s", type=float, default=0.00001)
    parser.add_argument("--weight-update-s", type=float, default=0.03)
    parser.add_argument("--train-step-s", default="0.4,0.8,1.6",
                        help="comma-separated: one regime each (0.8 is about the sync rollout median, printed)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies every sleep (0: no sleeps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "async_rollout.json"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if "sync" in modes:
        modes.remove("sync")
    modes.insert(0, "sync")

    workload = Workload(prompt_len=args.prompt_len, median_response_len=args.median_response_len,
                        p99_over_median=args.p99_over_median, max_response_len=args.max_response_len, seed=args.seed)
    shape = RunShape(groups_per_step=args.groups, samples_per_group=args.samples, steps=args.steps, warmup=args.warmup)
    lengths = sorted(workload.response_len(p, j) for p in range(args.groups * args.steps) for j in range(args.samples))
    print(f"workload: {len(lengths)} responses, length median {lengths[len(lengths) // 2]}, "
          f"p99 {lengths[int(0.99 * (len(lengths) - 1))]}, max {lengths[-1]} tokens (sigma {workload.sigma:.3f})")
    regimes = []
    for train_step_s in (float(v) for v in args.train_step_s.split(",")):
        cost = CostModel(decode_step_s=args.decode_step_s, prefill_token_s=args.prefill_token_s,
                         weight_update_s=args.weight_update_s, train_step_s=train_step_s, time_scale=args.time_scale)
        regimes.append(run_regime(modes, cost, workload, shape))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"settings": {k: v for k, v in vars(args).items() if k != "out"}, "regimes": regimes}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
