"""The demo's GRPO phase run in several arms from one SFT start, over seeds: what `bench/lora_learning.py`
(full fine-tuning against LoRA) and `bench/async_rollout/demo_task.py` (sync against async) compare.

The demo's SFT phase runs once (seed 0, its settings); then for each seed, each arm's GRPO phase (the demo's
settings plus the arm's run values) runs from that SFT model, and its export's held-out greedy accuracy is
measured with transformers as the demo does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Callable, Sequence


def run_demo_grpo_arms(arms: dict[str, dict | Callable[[int, dict], dict]], seeds: Sequence[int], *,
                       work_prefix: str, settings=None) -> tuple[float, list[dict]]:
    """(the SFT model's held-out accuracy, a row per run: seed, mode (the arm's name), seconds, accuracy).

    An arm's run values may be a function of (seed, exports): `exports` maps "sft" and each earlier arm of the same
    seed to its exported Hugging Face folder (what an arm started from another arm's result needs).
    `settings`: the demo's `DemoSettings` (default: the demo's own, without a progress bar)."""
    from stacx.launch.demo import measure
    from stacx.launch.demo.phases import demo_run_config, train
    from stacx.launch.demo.pipeline import DemoSettings, _prepare, _save_tokenizer
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.tasks import get_task
    from stacx.trainer.cluster.ray.connect import connect_ray

    settings = settings or DemoSettings(progress_bar=False)
    task = get_task(settings.task)
    tokenizer = build_char_tokenizer(task.alphabet)
    max_new_tokens = task.max_answer_chars + 1
    work = tempfile.mkdtemp(prefix=work_prefix)
    paths = _prepare(settings, work)
    with open(paths["eval"]) as handle:
        eval_rows = [json.loads(line) for line in handle][: settings.num_eval_prompts]

    def accuracy(path: str) -> float:
        return measure.greedy_accuracy(measure.load_reference_model(path), tokenizer, eval_rows,
                                       max_new_tokens=max_new_tokens)

    connection = connect_ray(None, log_to_driver=False)
    runs = []
    try:
        train(demo_run_config(settings, work, "sft", {
            **settings.sft.run_values(), "hf_checkpoint": paths["init"], "prompt_data": paths["train"],
            "export_hf": paths["sft"]}))
        _save_tokenizer(task.name, paths["sft"])
        start_accuracy = accuracy(paths["sft"])
        print(f"SFT model: held-out accuracy {start_accuracy:.3f}", flush=True)
        for seed in seeds:
            exports = {"sft": paths["sft"]}
            for index, (mode, values) in enumerate(arms.items()):
                name = f"grpo_arm{index}_seed{seed}"
                export = os.path.join(work, "checkpoints", name)
                values = values(seed, exports) if callable(values) else values
                config = demo_run_config(dataclasses.replace(settings, seed=seed), work, name, {
                    **settings.grpo.run_values(), "hf_checkpoint": paths["sft"], "ref_load": paths["sft"],
                    "prompt_data": paths["train"], "rollout_max_response_len": max_new_tokens, "export_hf": export,
                    **values})
                started = time.monotonic()
                train(config)
                seconds = time.monotonic() - started
                _save_tokenizer(task.name, export)
                exports[mode] = export
                runs.append({"seed": seed, "mode": mode, "seconds": seconds, "accuracy": accuracy(export)})
                print(f"seed {seed} {mode:9s}: held-out accuracy {runs[-1]['accuracy']:.3f} in {seconds:.1f} s",
                      flush=True)
    finally:
        connection.shutdown()
    return start_accuracy, runs


def demo_grpo_lr() -> float:
    """The demo's GRPO learning rate (the full fine-tune's)."""
    from stacx.launch.demo.pipeline import DemoSettings

    return DemoSettings(progress_bar=False).grpo.lr
