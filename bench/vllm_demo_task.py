"""The demo's GRPO phase rolled out by vLLM against the CPU engine: held-out accuracy, same seeds.

    python bench/vllm_demo_task.py --vllm-python ENV/bin/python [--seeds 0 1 2] [--out bench/results/vllm_demo_task.json]

The demo's SFT phase runs once (seed 0) on a demo-sized model with two heads of 32 (vLLM's CPU attention takes
head sizes from 32 up; the demo's own model has four heads of 16); then, for each seed, the demo's GRPO phase
(40 steps x 16 prompts x 8 samples, exact-match reward) runs from that SFT model twice: rolled out by the CPU engine
(`--rollout-engine cpu`, a `stacx serve` child) and by vLLM (`--rollout-engine vllm`, a vLLM server the run starts
from `--vllm-python`'s environment, weights pushed and digest-checked after every step). Each run's held-out greedy
accuracy (128 prompts, measured with transformers as the demo does) and wall time are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("STACX_VLLM_PYTHON"),
                        help="vLLM's environment's python (default: $STACX_VLLM_PYTHON)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--engines", nargs="+", default=["cpu", "vllm"], choices=["cpu", "vllm"])
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "vllm_demo_task.json"))
    args = parser.parse_args(argv)
    if "vllm" in args.engines and not args.vllm_python:
        parser.error("--vllm-python (or STACX_VLLM_PYTHON) is needed for the vllm arm")

    from bench.demo_grpo_arms import run_demo_grpo_arms
    from stacx.launch.demo.phases import TinyModel
    from stacx.launch.demo.pipeline import DemoSettings

    defaults = DemoSettings(progress_bar=False)
    settings = DemoSettings(progress_bar=False, teacher=TinyModel(
        hidden_size=defaults.teacher.hidden_size, num_layers=defaults.teacher.num_layers,
        num_attention_heads=defaults.teacher.hidden_size // 32))
    arms = {"cpu": {"rollout_engine": "cpu"},
            "vllm": {"rollout_engine": "vllm", "vllm_python": args.vllm_python}}
    arms = {engine: arms[engine] for engine in args.engines}
    start_accuracy, runs = run_demo_grpo_arms(arms, args.seeds, work_prefix="stacx-vllm-demo-", settings=settings)

    summary = {}
    for engine in arms:
        mine = [run for run in runs if run["mode"] == engine]
        summary[engine] = {"accuracy_mean": statistics.mean(r["accuracy"] for r in mine),
                           "accuracy_min": min(r["accuracy"] for r in mine),
                           "accuracy_max": max(r["accuracy"] for r in mine),
                           "seconds_mean": statistics.mean(r["seconds"] for r in mine)}
        print(f"{engine:5s}: held-out accuracy {start_accuracy:.3f} -> {summary[engine]['accuracy_mean']:.3f} "
              f"(seeds {[round(r['accuracy'], 3) for r in mine]}), {summary[engine]['seconds_mean']:.1f} s per run")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"benchmark": "vllm_demo_task", "sft_accuracy": start_accuracy, "runs": runs,
                   "summary": summary, "model": settings.teacher.describe() + ", 2 heads of 32"}, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
