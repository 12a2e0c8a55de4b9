"""What --dump-rollouts costs on the demo's task, and how fast --replay-rollouts trains from the dump.

    python bench/rollout_dump.py [--steps 10] [--out bench/results/rollout_dump.json]          # the writer alone
    python bench/rollout_dump.py --runs [--steps 10] [--out ...]                               # three training runs
    python bench/rollout_dump.py --runs --in-process-engine [--steps 3]                        # engine in this process

Default: the dump writer alone on `--steps` step batches of the demo's GRPO shape (16 prompts x 8 samples
of the sorting task, the char tokenizer's prompt ids, responses at the task's length limit, the fields a
GRPO rollout fills): seconds and bytes per step file, written and read back (what a replay reads).

With --runs: the demo's GRPO phase (16 prompts x 8 samples, KL to the reference, the CPU engine as a `stacx serve`
child) runs `--steps` steps from the demo's initial model three times on one trainer rank (the torchrun
loop in this process: no Ray start on a busy machine): plain, with --dump-rollouts, and replaying that
dump (no engine). The initial model is random, so every response runs to
the task's length limit: the bytes are the demo task's most per step. Printed: the dump's seconds and bytes
per step (the runs' own `time/rollout_dump_s` and `rollout_dump/bytes`), and each run's mean step time
(`time/step_s`, steps after the first) and wall time, and each run's ratio to the plain run's step time; the
replay's losses are checked equal to the dump's. --in-process-engine serves the initial model from a fresh
engine server in this process for each run (attached, `--rollout-engine http`) instead of a `stacx serve`
child: no child start on a busy machine.
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
    parser.add_argument("--runs", action="store_true", help="three training runs (plain, dump, replay), not the writer alone")
    parser.add_argument("--in-process-engine", action="store_true",
                        help="serve the engine in this process (a fresh server per run) instead of a stacx serve child")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "rollout_dump.json"))
    args = parser.parse_args(argv)
    if not args.runs:
        return measure_writer(args.steps, args.out)

    from stacx.launch.demo.phases import demo_run_config
    from stacx.launch.demo.pipeline import DemoSettings, _prepare
    from stacx.tasks import get_task
    from stacx.testing.distributed import find_free_port
    from stacx.trainer.spmd import run_spmd

    settings = DemoSettings(progress_bar=False)
    task = get_task(settings.task)
    work = tempfile.mkdtemp(prefix="stacx-rollout-dump-")
    paths = _prepare(settings, work)
    dump = os.path.join(work, "dump")
    base = {**settings.grpo.run_values(), "num_steps": args.steps, "hf_checkpoint": paths["init"],
            "ref_load": paths["init"], "prompt_data": paths["train"], "rollout_max_response_len": task.max_answer_chars + 1}
    runs = {"plain": {}, "dump": {"dump_rollouts": dump}, "replay": {"replay_rollouts": dump}}
    results = {}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for name, values in runs.items():
        os.environ["MASTER_PORT"] = str(find_free_port())  # each run's teardown ends its process group
        server = None
        if args.in_process_engine and name != "replay":  # a replay starts no engine
            server = _serve(paths["init"])
            values = {**values, "rollout_engine": "http", "rollout_urls": [server.url]}
        started = time.monotonic()
        try:
            run_spmd(demo_run_config(settings, work, name, {**base, **values}))
        finally:
            if server is not None:
                server.stop()
        rows = _rows(os.path.join(work, name))
        results[name] = {"wall_s": time.monotonic() - started,
                         "step_s_mean": statistics.mean(row["time/step_s"] for row in rows[1:]),
                         "losses": [row["policy/loss"] for row in rows]}
        if name == "dump":
            results[name]["dump_s_per_step"] = statistics.mean(row["time/rollout_dump_s"] for row in rows)
            results[name]["dump_bytes_per_step"] = statistics.mean(row["rollout_dump/bytes"] for row in rows)
        print(f"{name:6s}: {results[name]['step_s_mean']:.3f} s per step, {results[name]['wall_s']:.1f} s wall",
              flush=True)
    for name in runs:
        results[name]["step_s_vs_plain"] = results[name]["step_s_mean"] / results["plain"]["step_s_mean"]
    dumped = results["dump"]
    dumped["dump_share_of_step"] = dumped["dump_s_per_step"] / dumped["step_s_mean"]
    assert results["replay"]["losses"] == dumped["losses"], "the replay's losses differ from the dumped run's"
    print(f"dump: {dumped['dump_s_per_step'] * 1000:.1f} ms and {dumped['dump_bytes_per_step'] / 1024:.1f} KiB per step "
          f"({settings.grpo.prompts_per_step} x {settings.grpo.samples_per_prompt} samples); replay losses equal")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"benchmark": "rollout_dump", "steps": args.steps, "runs": results}, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


def _serve(checkpoint: str):
    """A fresh CPU engine server in this process on `checkpoint` (its key in STACX_API_KEY, which the run sends)."""
    import secrets

    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer

    key = secrets.token_urlsafe(16)
    os.environ["STACX_API_KEY"] = key
    ensure_single_process_layout()
    return EngineHttpServer(CpuEngine.from_hf_checkpoint(checkpoint, seed=0), api_key=key).start()


def demo_shaped_batch(step: int):
    """A GRPO step batch of the demo's shape: its prompts, responses of the task's longest answer."""
    import torch

    from stacx.launch.demo.pipeline import DemoSettings
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.tasks import get_task, resolve_data_path
    from stacx.trainer.batch import StepBatch

    settings = DemoSettings()
    task = get_task(settings.task)
    tokenizer = build_char_tokenizer(task.alphabet)
    rows_path = resolve_data_path(f"builtin:{settings.task}", out_dir=tempfile.mkdtemp(prefix="stacx-dump-bench-"))
    with open(rows_path) as handle:
        rows = [json.loads(line) for line in handle][: settings.grpo.prompts_per_step * (step + 1)]
    prompts = [tokenizer.encode(row["prompt"]) for row in rows[-settings.grpo.prompts_per_step:]]
    generator = torch.Generator().manual_seed(step)
    length = task.max_answer_chars + 1
    tokens, masks, log_probs, executors, rewards, groups = [], [], [], [], [], []
    for group, prompt in enumerate(prompts):
        for _ in range(settings.grpo.samples_per_prompt):
            response = torch.randint(0, len(tokenizer), (length,), generator=generator)
            tokens.append(torch.cat([torch.tensor(prompt, dtype=torch.long), response]))
            masks.append(torch.ones(length))
            log_probs.append(-torch.rand(length, generator=generator))
            executors.append(torch.ones(length, dtype=torch.long))
            rewards.append(float(torch.rand((), generator=generator) > 0.5))
            groups.append(group)
    return StepBatch(tokens=tokens, response_lengths=[length] * len(tokens), loss_masks=masks,
                     rollout_log_probs=log_probs, executors=executors, rewards=rewards, prompt_id=groups)


def measure_writer(steps: int, out: str) -> int:
    from stacx.trainer.rollout_dump import RolloutDumpWriter, RolloutReplay

    folder = tempfile.mkdtemp(prefix="stacx-dump-bench-")
    writer = RolloutDumpWriter(folder, recipe="grpo", seed=0)
    batches = [demo_shaped_batch(step) for step in range(steps)]
    written = [writer.write(step, batch, {"rollout/reward_mean": 0.5}) for step, batch in enumerate(batches)]
    replay = RolloutReplay(folder)
    read_s = []
    for step in range(steps):
        started = time.perf_counter()
        replay.read(step)
        read_s.append(time.perf_counter() - started)
    result = {"benchmark": "rollout_dump_writer", "steps": steps, "samples_per_step": batches[0].num_samples,
              "tokens_per_step": sum(len(t) for t in batches[0].tokens),
              "write_s_per_step": statistics.mean(s for s, _ in written),
              "write_s_median": statistics.median(s for s, _ in written),
              "bytes_per_step": statistics.mean(b for _, b in written), "read_s_per_step": statistics.mean(read_s)}
    print(f"{result['samples_per_step']} samples, {result['tokens_per_step']} tokens per step: write "
          f"{result['write_s_per_step'] * 1000:.1f} ms (median {result['write_s_median'] * 1000:.1f} ms), "
          f"{result['bytes_per_step'] / 1024:.1f} KiB, read back {result['read_s_per_step'] * 1000:.1f} ms per step")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
