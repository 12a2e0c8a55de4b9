"""What --dump-rollouts costs on the demo's task, and how fast --replay-rollouts trains from the dump.

    python bench/rollout_dump.py [--steps 10] [--out bench/results/rollout_dump.json]

The demo's GRPO phase (16 prompts x 8 samples, KL to the reference, the CPU engine as a `stacx serve`
child, one trainer rank on Ray) runs `--steps` steps from the demo's initial model three times: plain, with
--dump-rollouts, and replaying that dump (no engine). The initial model is random, so every response runs to
the task's length limit: the bytes are the demo task's most per step. Printed: the dump's seconds and bytes
per step (the runs' own `time/rollout_dump_s` and `rollout_dump/bytes`), and each run's mean step time
(`time/step_s`, steps after the first) and wall time; the replay's losses are checked equal to the dump's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _rows(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "rollout_dump.json"))
    args = parser.parse_args(argv)

    from stacx.launch.demo.phases import demo_run_config, train
    from stacx.launch.demo.pipeline import DemoSettings, _prepare
    from stacx.tasks import get_task
    from stacx.trainer.cluster.ray.connect import connect_ray

    settings = DemoSettings(progress_bar=False)
    task = get_task(settings.task)
    work = tempfile.mkdtemp(prefix="stacx-rollout-dump-")
    paths = _prepare(settings, work)
    dump = os.path.join(work, "dump")
    base = {**settings.grpo.run_values(), "num_steps": args.steps, "hf_checkpoint": paths["init"],
            "ref_load": paths["init"], "prompt_data": paths["train"], "rollout_max_response_len": task.max_answer_chars + 1}
    runs = {"plain": {}, "dump": {"dump_rollouts": dump}, "replay": {"replay_rollouts": dump}}
    results = {}
    connection = connect_ray(None, log_to_driver=False)
    try:
        for name, values in runs.items():
            started = time.monotonic()
            train(demo_run_config(settings, work, name, {**base, **values}))
            rows = _rows(os.path.join(work, name))
            results[name] = {"wall_s": time.monotonic() - started,
                             "step_s_mean": statistics.mean(row["time/step_s"] for row in rows[1:]),
                             "losses": [row["policy/loss"] for row in rows]}
            if name == "dump":
                results[name]["dump_s_per_step"] = statistics.mean(row["time/rollout_dump_s"] for row in rows)
                results[name]["dump_bytes_per_step"] = statistics.mean(row["rollout_dump/bytes"] for row in rows)
            print(f"{name:6s}: {results[name]['step_s_mean']:.3f} s per step, {results[name]['wall_s']:.1f} s wall",
                  flush=True)
    finally:
        connection.shutdown()
    dumped = results["dump"]
    assert results["replay"]["losses"] == dumped["losses"], "the replay's losses differ from the dumped run's"
    print(f"dump: {dumped['dump_s_per_step'] * 1000:.1f} ms and {dumped['dump_bytes_per_step'] / 1024:.1f} KiB per step "
          f"({settings.grpo.prompts_per_step} x {settings.grpo.samples_per_prompt} samples); replay losses equal")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"benchmark": "rollout_dump", "steps": args.steps, "runs": results}, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
