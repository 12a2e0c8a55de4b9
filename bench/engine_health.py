"""What watching the rollout engines costs: seconds per rollout step on the demo's task, with and without
the engine pool's supervisor (stacx.rollout.engine_health).

    python bench/engine_health.py [--rounds 20 --prompts 16 --samples 8]

Two `stacx serve` processes serve a tiny random model of the demo's task (sorting: the demo's GRPO
phase has 16 prompts x 8 samples, answers of at most 6 tokens). One rollout step is what the driver
does with the engines each step: one `generate` of every sample, spread over the two engines, then the
weight-update handshake (pause, flush, resume, read each engine's version; no weights move). Three
pools, alternated round by round in one process:
  unwatched      EnginePool without a supervisor (failures are raised: the behaviour before)
  default        supervised with the run defaults (a health check every 10 s of a call in flight)
  every 10 ms    supervised with --engine-health-interval-s 0.01 (a check every 10 ms of a call)
Prints and writes (bench/results/engine_health.json) the median seconds per step of each, the
supervised/unwatched ratio and the seconds spent in health checks per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "engine_health.json"))
    args = parser.parse_args(argv)

    import random

    from stacx.rollout.engine_pool import EnginePool
    from stacx.rollout.engines.http import HttpEngine
    from stacx.rollout.engines.launchers import CpuServerProcess
    from stacx.rollout.sections import RolloutSection
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.wire.types import GenerateRequest, SamplingParams
    from stacx.tasks import get_task, write_tiny_checkpoint

    task = get_task("sorting")
    tokenizer = build_char_tokenizer(task.alphabet)
    checkpoint = write_tiny_checkpoint(os.path.join(tempfile.mkdtemp(prefix="stacx-engine-health-"), "sorting"),
                                       "sorting", seed=0)
    servers = [CpuServerProcess(checkpoint, seed=index, api_key="bench") for index in range(2)]
    try:
        urls = [server.url for server in servers]
        rng = random.Random(0)
        prompts = [tokenizer(task.sample(rng)[0], add_special_tokens=False)["input_ids"] for _ in range(args.prompts)]
        sampling = SamplingParams(max_new_tokens=task.max_answer_chars + 1, stop_token_ids=(tokenizer.eos_token_id,))

        def pool(settings):
            engines = EnginePool([HttpEngine(url, api_key="bench") for url in urls], names=urls)
            if settings is not None:
                engines.supervise(settings=settings)
            return engines

        pools = {"unwatched": pool(None), "default": pool(RolloutSection()),
                 "every 10 ms": pool(RolloutSection(engine_health_interval_s=0.01))}
        times = {name: [] for name in pools}
        seed = 0
        for _ in range(args.rounds):
            for name, engines in pools.items():
                requests = []
                for prompt in prompts:
                    for _ in range(args.samples):
                        seed += 1
                        requests.append(GenerateRequest(input_ids=tuple(prompt), return_logprob=True,
                                                        sampling=SamplingParams(**{**sampling.__dict__, "seed": seed})))
                started = time.perf_counter()
                engines.generate(requests)
                engines.pause()
                engines.flush_cache()
                engines.resume()
                engines.weight_versions()
                times[name].append(time.perf_counter() - started)
        rows = {}
        base = statistics.median(times["unwatched"])
        for name, engines in pools.items():
            health = engines.supervisor.health_check_s / args.rounds if engines.supervisor is not None else 0.0
            rows[name] = {"median_s_per_step": statistics.median(times[name]),
                          "ratio_to_unwatched": statistics.median(times[name]) / base,
                          "health_check_s_per_step": health}
            print(f"{name:>12}: {rows[name]['median_s_per_step']:.4f} s/step "
                  f"({rows[name]['ratio_to_unwatched']:.3f}x unwatched), health checks {health:.4f} s/step")
        result = {"task": "sorting", "prompts": args.prompts, "samples": args.samples, "rounds": args.rounds,
                  "engines": 2, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                  "load_average": os.getloadavg(), "pools": rows}
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
        for engines in pools.values():
            engines.shutdown()
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
