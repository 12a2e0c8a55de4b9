"""`stacx demo --diffusion`: the experimental diffusion recipes end to end on CPU (a few minutes).

1. A tiny SD3-style MMDiT (16x16 RGB pixels, text conditioner) is trained from scratch by
   `flow_matching_sft` on a washed-out dataset of coloured shapes ("a red circle": the colour is
   dimmed and noisy, as an imperfect dataset would be).
2. `flow_grpo` then trains it on the `color` reward (how close the drawn colour is to the one the
   prompt names) from groups of SDE samples.

The held-out reward (ODE samples of prompts that neither phase trains on, fixed noise) is
measured before SFT, after SFT and during Flow-GRPO. Outputs in the demo folder: summary.json
(before / after figures), samples.png (held-out samples: initial, after SFT, after Flow-GRPO),
reward_curve.png, the phases' metrics.jsonl and their checkpoints in the diffusers layout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from stacx.launch.demo.phases import OnPolicyPhase, SftPhase


@dataclass(frozen=True, kw_only=True)
class DiffusionDemoSettings:
    """Sizes of the demo's two phases (the defaults take a few minutes on 2 CPU cores)."""

    seed: int = 0
    """Seed of the models, data and sampling."""
    sft: SftPhase = SftPhase(recipe="flow_matching_sft", steps=250, batch_size=32, lr=2e-3)
    """Supervised phase (a batch is images)."""
    rl: OnPolicyPhase = OnPolicyPhase(recipe="flow_grpo", steps=60, prompts_per_step=4, samples_per_prompt=8, lr=1e-3)
    """Flow-GRPO phase (samples are images; no KL loss)."""
    num_inference_steps: int = 6
    """Denoising steps of every sampler."""
    eval_every: int = 10
    """Flow-GRPO steps between two held-out evaluations."""
    eval_samples_per_prompt: int = 4
    """Held-out samples per prompt (fixed noise)."""
    reward: str = "color"
    """The image reward Flow-GRPO trains on and the held-out figure."""


def _run_config(*flags: str):
    from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(list(flags)))


def _common_flags(settings: DiffusionDemoSettings, out: str) -> list[str]:
    return ["--seed", str(settings.seed), "--out", out, "--no-progress-bar", "--no-tensorboard",
            "--algorithm-param", f"num_inference_steps={settings.num_inference_steps}",
            "--algorithm-param", f"image_reward={settings.reward}"]


def _evaluate(run, settings: DiffusionDemoSettings) -> dict:
    from stacx.diffusion.prompts import HELD_OUT_PROMPTS

    return run.evaluate(HELD_OUT_PROMPTS, seed=settings.seed + 7, num_per_prompt=settings.eval_samples_per_prompt)


def run_diffusion_demo(settings: DiffusionDemoSettings, out: str, *, log=print) -> dict:
    """Run both phases on one local Ray cluster and one set of policy workers; returns the summary."""
    from stacx.diffusion.loop import DiffusionRun
    from stacx.diffusion.prompts import HELD_OUT_PROMPTS
    from stacx.launch.workloads import discover_workloads
    from stacx.trainer.cluster.ray.connect import connect_ray
    from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers
    from stacx.trainer.recipes import get_recipe

    discover_workloads()
    started = time.monotonic()
    os.makedirs(out, exist_ok=True)
    checkpoints = os.path.join(out, "checkpoints")
    connection = connect_ray(log_to_driver=False)
    graph = None
    try:
        graph = create_role_workers(get_recipe(settings.rl.recipe), WorkerLayout(data_parallel_size=1))
        sft_config = _run_config("--algorithm", settings.sft.recipe, "--rollout-batch-size", str(settings.sft.batch_size),
                                 "--lr", str(settings.sft.lr), "--num-steps", str(settings.sft.steps),
                                 "--algorithm-param", "data_color_scale=0.5", "--algorithm-param", "data_color_noise=0.2",
                                 "--algorithm-param", f"micro_batch_size={settings.sft.batch_size}",
                                 *_common_flags(settings, os.path.join(out, "sft")))
        sft = DiffusionRun(sft_config, get_recipe(settings.sft.recipe), graph=graph)
        initial = _evaluate(sft, settings)
        log(f"[demo] held-out {settings.reward} reward of the untrained model: {initial['reward_mean']:.3f}")
        sft_rows = _train(sft, sft_config, settings.sft.recipe, log, every=50)
        after_sft = _evaluate(sft, settings)
        sft.save(os.path.join(checkpoints, "sft"))
        log(f"[demo] held-out reward after SFT: {after_sft['reward_mean']:.3f}")

        rl_config = _run_config("--algorithm", settings.rl.recipe, "--hf-checkpoint", os.path.join(checkpoints, "sft"),
                                "--rollout-batch-size", str(settings.rl.prompts_per_step),
                                "--n-samples-per-prompt", str(settings.rl.samples_per_prompt), "--lr", str(settings.rl.lr),
                                "--num-steps", str(settings.rl.steps), "--algorithm-param", "micro_batch_size=16",
                                *_common_flags(settings, os.path.join(out, "flow_grpo")))
        rl = DiffusionRun(rl_config, get_recipe(settings.rl.recipe), graph=graph)
        held_out_curve = [(0, after_sft["reward_mean"])]

        def evaluate_rl(step):
            if (step + 1) % settings.eval_every == 0 or step + 1 == settings.rl.steps:
                held_out_curve.append((step + 1, _evaluate(rl, settings)["reward_mean"]))
                log(f"[demo] flow_grpo step {step + 1}: held-out reward {held_out_curve[-1][1]:.3f}")

        rl_rows = _train(rl, rl_config, settings.rl.recipe, log, every=10, after_step=evaluate_rl)
        after_rl = _evaluate(rl, settings)
        rl.save(os.path.join(checkpoints, "flow_grpo"))
    finally:
        if graph is not None:
            graph.shutdown()
        connection.shutdown()
    figures = {"initial": initial["reward_mean"], "after_sft": after_sft["reward_mean"],
               "after_flow_grpo": after_rl["reward_mean"]}
    summary = {
        "held_out_prompts": list(HELD_OUT_PROMPTS),
        "reward": settings.reward,
        "held_out_reward": figures,
        "flow_grpo_gain": figures["after_flow_grpo"] - figures["after_sft"],
        "held_out_curve": held_out_curve,
        "train_reward_curve": [row["reward_mean"] for row in rl_rows],
        "sft_loss_curve": [row["fm_loss"] for row in sft_rows],
        "seconds": time.monotonic() - started,
        "settings": asdict(settings),
        "outputs": {"samples": os.path.join(out, "samples.png"), "reward_curve": os.path.join(out, "reward_curve.png"),
                    "checkpoints": checkpoints},
    }
    draw_samples(os.path.join(out, "samples.png"), HELD_OUT_PROMPTS, settings.eval_samples_per_prompt,
                 [("initial", initial), ("after SFT", after_sft), ("after Flow-GRPO", after_rl)])
    draw_reward_curve(os.path.join(out, "reward_curve.png"), summary)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _train(run, run_config, name, log, *, every, after_step=None) -> list[dict]:
    rows = []
    os.makedirs(run_config.logging.out, exist_ok=True)
    with open(os.path.join(run_config.logging.out, "metrics.jsonl"), "w") as f:
        for step in range(run_config.train.num_steps):
            metrics = run.train_step(step)
            rows.append(metrics)
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            if (step + 1) % every == 0:
                shown = ", ".join(f"{k} {v:.3g}" for k, v in metrics.items() if k in ("fm_loss", "reward_mean", "kl_loss"))
                log(f"[demo] {name} step {step + 1}/{run_config.train.num_steps}: {shown}")
            if after_step is not None:
                after_step(step)
    return rows


def _to_rgb(image_CHW: torch.Tensor):
    return ((image_CHW.clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()


def draw_samples(path: str, prompts, per_prompt: int, rows: list[tuple[str, dict]]) -> None:
    """One row per stage, one column per held-out sample, the prompt above its columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = len(prompts) * per_prompt
    fig, axes = plt.subplots(len(rows), columns, figsize=(columns * 0.9, len(rows) * 1.1 + 0.6), squeeze=False)
    for r, (label, result) in enumerate(rows):
        for c in range(columns):
            ax = axes[r][c]
            ax.imshow(_to_rgb(result["images"][c]), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if c % per_prompt == 0 and r == 0:
                ax.set_title(prompts[c // per_prompt], fontsize=8, loc="left")
            if c == 0:
                ax.set_ylabel(f"{label}\n{result['reward_mean']:.2f}", fontsize=8)
    fig.suptitle("held-out prompts: samples and mean colour reward", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_reward_curve(path: str, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = summary["train_reward_curve"]
    ax.plot(range(1, len(train) + 1), train, alpha=0.4, label="train reward (SDE samples)")
    steps, values = zip(*summary["held_out_curve"])
    ax.plot(steps, values, marker="o", label="held-out reward (ODE samples)")
    ax.axhline(summary["held_out_reward"]["initial"], color="grey", linestyle=":", label="held-out, untrained model")
    ax.set_xlabel("Flow-GRPO step")
    ax.set_ylabel(f"{summary['reward']} reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_summary(summary: dict) -> str:
    figures = summary["held_out_reward"]
    return (f"held-out {summary['reward']} reward: untrained {figures['initial']:.3f} -> after SFT "
            f"{figures['after_sft']:.3f} -> after Flow-GRPO {figures['after_flow_grpo']:.3f} "
            f"(Flow-GRPO {summary['flow_grpo_gain']:+.3f}) in {summary['seconds']:.0f} s")
