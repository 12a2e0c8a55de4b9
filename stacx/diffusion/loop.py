"""The driver loop of a diffusion recipe: `stacx train --algorithm flow_grpo` lands here.

    run = DiffusionRun(run_config, recipe)           # Ray, the policy's RoleWorkers, models built
    for step in range(run_config.train.num_steps):
        metrics = run.train_step(step)               # sample + score + advantages + one optimizer step
    run.save(run_config.model.save); run.close()

One step of each kind (the recipe's specialization says which):

- sft:  the driver draws the step's prompts, renders their target images (built-in data), t and
        eps per image, splits them over the DP ranks; each rank takes one flow-matching step.
- dpo:  the same with (chosen, rejected) pairs sharing t and eps.
- grpo: prompts are split over the DP ranks (a prompt's group stays on one rank); each rank
        samples its groups with the SDE sampler and scores them; the driver turns rewards into
        group advantages with the registered estimator and each rank trains on its trajectories.
- nft:  as grpo, with ODE samples and the forward-process loss (t and eps drawn per image).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from typing import Sequence

import torch

from stacx.diffusion.settings import DiffusionSettings


def diffusion_settings(recipe, run_config) -> DiffusionSettings:
    """The recipe's declared settings with the run's --algorithm-param values and --reward-fn laid over them.
    Also refuses tensor / context parallelism, which the diffusion recipes do not support."""
    from stacx.diffusion.recipes import DIFFUSION_SETTINGS

    parallel = run_config.parallel
    for flag, value in (("--tensor-model-parallel-size", parallel.tensor_model_parallel_size),
                        ("--context-parallel-size", parallel.context_parallel_size)):
        if value != 1:
            raise ValueError(f"{flag} {value}: the diffusion recipes run data parallel only (the model is replicated "
                             f"on every rank); set {flag} 1 and scale with --data-parallel-size")
    settings = DIFFUSION_SETTINGS[recipe.name].with_overrides(dict(run_config.algorithm.extras))
    if "reward_fn" in run_config.given_keys:
        settings = dataclasses.replace(settings, image_reward=run_config.rollout.reward_fn)
    return settings


def kernel_config(recipe, run_config, settings: DiffusionSettings):
    """The AlgorithmConfig the kernels read: the recipe's defaults under the user's values, plus the
    diffusion-only knobs the kernels need (nft_beta, nft_advantage_clip, diffusion_dpo_beta) as custom keys."""
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.trainer.config.resolve import resolve_algorithm_config

    algorithm = resolve_algorithm_config(recipe, run_config)
    values = {**algorithm.to_dict(), "nft_beta": settings.nft_beta, "nft_advantage_clip": settings.nft_advantage_clip,
              "diffusion_dpo_beta": settings.dpo_beta}
    return AlgorithmConfig.from_values(values, given_keys=algorithm.given_keys)


def model_source(run_config, settings: DiffusionSettings):
    """The checkpoint folder of --hf-checkpoint, or a fresh model config from the settings."""
    from stacx.diffusion.checkpoint import load_diffusion_config
    from stacx.diffusion.config import DiffusionModelConfig
    from stacx.diffusion.prompts import ALL_PROMPTS, VOCABULARY

    if run_config.model.hf_checkpoint:
        load_diffusion_config(run_config.model.hf_checkpoint)  # fails early, naming the folder
        return run_config.model.hf_checkpoint
    label = settings.model_family == "dit"
    return DiffusionModelConfig(family=settings.model_family, conditioner="label" if label else "text",
                                image_size=settings.image_size, num_layers=settings.num_layers,
                                vocabulary=ALL_PROMPTS if label else VOCABULARY)


def load_prompts(run_config) -> tuple[str, ...]:
    """Training prompts: --prompt-data (JSONL, --input-key) or the built-in colour / shape set."""
    from stacx.diffusion.prompts import TRAIN_PROMPTS

    path = run_config.rollout.prompt_data
    if not path:
        return TRAIN_PROMPTS
    if not os.path.isfile(path):
        raise ValueError(f"--prompt-data {path!r}: no such file (diffusion recipes read a JSONL of prompts, or use "
                         "the built-in colour / shape prompts when --prompt-data is not set)")
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if run_config.rollout.input_key not in row:
                    raise ValueError(f"--prompt-data {path!r} line {number}: no key {run_config.rollout.input_key!r} "
                                     "(--input-key)")
                prompts.append(str(row[run_config.rollout.input_key]))
    return tuple(prompts)


def split_evenly(items: Sequence, num_parts: int, what: str) -> list[list]:
    if len(items) % num_parts:
        raise ValueError(f"{what} ({len(items)}) must be divisible by the data-parallel size ({num_parts})")
    size = len(items) // num_parts
    return [list(items[i * size:(i + 1) * size]) for i in range(num_parts)]


class DiffusionRun:
    """A diffusion recipe's run: the policy's Ray role workers and the step functions."""

    def __init__(self, run_config, recipe, *, layout=None, graph=None):
        """`graph`: a running `RoleWorkerGraph` with a `policy` role to run on (kept open by `close`;
        tests run several recipes on one set of workers); None starts the recipe's own workers."""
        from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers
        from stacx.trainer.cluster.ray.connect import connect_ray

        self.run_config, self.recipe = run_config, recipe
        self.settings = diffusion_settings(recipe, run_config)
        self.config = kernel_config(recipe, run_config, self.settings)
        self.prompts = load_prompts(run_config)
        role = recipe.role("policy")
        self.kind = role.specialization_cls.kind
        self.owns_graph = graph is None
        self.connection = connect_ray(run_config.parallel.ray_address) if self.owns_graph else None
        try:
            self.graph = graph or create_role_workers(recipe, layout or WorkerLayout.from_parallel_section(
                run_config.parallel))
        except BaseException:
            self.connection.shutdown()
            raise
        self.workers = self.graph.workers["policy"]
        self.dp = self.workers.data_parallel_size
        seed = run_config.train.seed
        reference = getattr(run_config.model, role.reference_checkpoint_arg) if role.reference_checkpoint_arg else None
        from stacx.diffusion.worker import build_policy

        try:
            self.info = self.workers.execute_all(
                build_policy, model_source=model_source(run_config, self.settings), reference_path=reference,
                specialization_cls=role.specialization_cls, config=self.config, settings=self.settings,
                lr=run_config.optim.lr, weight_decay=run_config.optim.weight_decay,
                clip_grad=run_config.optim.clip_grad, seed=seed)[0]
        except BaseException:
            self.close(failed=True)
            raise

    # ---- one step -----------------------------------------------------------------------------
    def _rng(self, step: int) -> tuple[random.Random, torch.Generator]:
        seed = self.run_config.train.seed * 100_003 + step
        return random.Random(seed), torch.Generator().manual_seed(seed)

    def _forward_noise(self, num: int, generator: torch.Generator, shape) -> dict:
        """t ~ U(0, 1) and eps per sample, drawn by the driver so every split sees the same draws."""
        return {"t": torch.rand(num, generator=generator), "noise": torch.randn((num, *shape), generator=generator)}

    def train_step(self, step: int) -> dict:
        started = time.monotonic()
        metrics = getattr(self, f"_{self.kind}_step")(step)
        metrics["step_time_s"] = time.monotonic() - started
        return metrics

    def _dataset_batch(self, step: int) -> list[dict]:
        from stacx.diffusion.prompts import COLORS, parse_prompt, render_target

        rng, generator = self._rng(step)
        size = self.run_config.rollout.rollout_batch_size
        if size % self.dp:
            raise ValueError(f"--rollout-batch-size ({size}) must be divisible by the data-parallel size ({self.dp})")
        prompts = [rng.choice(self.prompts) for _ in range(size)]
        shape = self._latent_shape()
        s = self.settings
        render = dict(generator=generator, color_noise=s.data_color_noise, max_offset=s.data_max_offset,
                      color_scale=s.data_color_scale)
        batch = {"prompts": prompts, **self._forward_noise(size, generator, shape)}
        if self.kind == "sft":
            batch["images"] = torch.stack([render_target(p, shape[-1], **render) for p in prompts])
        else:  # dpo: chosen drawn in the named colour, rejected in another one, same shape and noise
            wrong = [rng.choice([c for c in COLORS if c != parse_prompt(p)[0]]) for p in prompts]
            batch["chosen"] = torch.stack([render_target(p, shape[-1], **render) for p in prompts])
            batch["rejected"] = torch.stack([render_target(p, shape[-1], color=c, generator=generator,
                                                           max_offset=s.data_max_offset)
                                             for p, c in zip(prompts, wrong)])
        parts = []
        for rank in range(self.dp):
            lo, hi = rank * size // self.dp, (rank + 1) * size // self.dp
            parts.append({k: v[lo:hi] for k, v in batch.items()})
        return parts

    def _latent_shape(self):
        if not hasattr(self, "_shape"):
            from stacx.diffusion.checkpoint import load_diffusion_config

            source = model_source(self.run_config, self.settings)
            config = source if not isinstance(source, str) else load_diffusion_config(source)
            self._shape = config.latent_shape
        return self._shape

    def _train_dataset(self, step: int) -> dict:
        from stacx.diffusion.worker import train_on_batch

        parts = self._dataset_batch(step)
        results = self.workers.execute_per_rank(train_on_batch, [(part, self.settings.micro_batch_size)
                                                                for part in parts])
        return dict(results[0])

    _sft_step = _train_dataset
    _dpo_step = _train_dataset

    def _rollout_step(self, step: int) -> dict:
        from stacx.diffusion.worker import sample_group_rollouts, train_on_rollout
        from stacx.objectives.registry import get_advantage

        rng, generator = self._rng(step)
        group = self.run_config.rollout.n_samples_per_prompt
        prompts = [rng.choice(self.prompts) for _ in range(self.run_config.rollout.rollout_batch_size)]
        per_rank = split_evenly(prompts, self.dp, "--rollout-batch-size")
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) for _ in range(self.dp)]
        sampled = self.workers.execute_per_rank(
            sample_group_rollouts, [(part, group, step, seeds[r], self.settings.image_reward)
                                    for r, part in enumerate(per_rank)])
        rewards = torch.tensor([r for result in sampled for r in result["rewards"]], dtype=torch.float64)
        prompt_ids = [i for i in range(len(prompts)) for _ in range(group)]
        advantages = get_advantage(self.config.advantage_estimator)(
            self.config, {"rewards": rewards, "response_lengths": [1] * len(rewards), "prompt_id": prompt_ids})
        advantages = [float(a[0]) for a in advantages]
        per_rank_adv = split_evenly(advantages, self.dp, "the step's samples")
        noise = None
        if self.kind == "nft":
            drawn = self._forward_noise(len(rewards), generator, self._latent_shape())
            noise = [{k: v[r * len(rewards) // self.dp:(r + 1) * len(rewards) // self.dp] for k, v in drawn.items()}
                     for r in range(self.dp)]
        results = self.workers.execute_per_rank(
            train_on_rollout, [(per_rank_adv[r], None if noise is None else noise[r], self.settings.micro_batch_size)
                               for r in range(self.dp)])
        metrics = dict(results[0])
        metrics.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0)
        return metrics

    _grpo_step = _rollout_step
    _nft_step = _rollout_step

    # ---- evaluation, checkpoints, teardown ------------------------------------------------------
    def evaluate(self, prompts: Sequence[str], *, seed: int = 0, num_per_prompt: int = 1) -> dict:
        """ODE samples of `prompts` (each `num_per_prompt` times, fixed noise) on rank 0; mean reward and images."""
        from stacx.diffusion.worker import evaluate_prompts

        expanded = [p for p in prompts for _ in range(num_per_prompt)]
        result = self.workers.execute_rank0(evaluate_prompts, expanded, seed, self.settings.image_reward,
                                            self.settings.num_inference_steps)
        return {"reward_mean": sum(result["rewards"]) / len(result["rewards"]), **result}

    def save(self, path: str) -> str:
        from stacx.diffusion.worker import save_policy

        return self.workers.execute_all(save_policy, path)[0]

    def close(self, failed: bool = False) -> None:
        if not self.owns_graph:
            return
        try:
            (self.graph.kill if failed else self.graph.shutdown)()
        finally:
            self.connection.shutdown()


def run_diffusion_training(run_config, recipe, *, layout=None, graph=None, log=print) -> dict:
    """Train `recipe` for --num-steps steps; metrics to <out>/metrics.jsonl; --save writes the policy
    in the diffusers layout. Returns the last step's metrics."""
    out = run_config.logging.out
    os.makedirs(out, exist_ok=True)
    run = DiffusionRun(run_config, recipe, layout=layout, graph=graph)
    metrics: dict = {}
    try:
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            for step in range(run_config.train.num_steps):
                metrics = run.train_step(step)
                f.write(json.dumps({"step": step, **metrics}) + "\n")
                f.flush()
                shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
                log(f"[{recipe.name}] step {step + 1}/{run_config.train.num_steps}: {shown}")
        if run_config.model.save:
            run.save(run_config.model.save)
            log(f"[{recipe.name}] saved the policy (diffusers layout) to {run_config.model.save}")
    except BaseException:
        run.close(failed=True)
        raise
    run.close()
    return metrics


def run_diffusion_command(run_config, recipe) -> int:
    """`stacx train` for a diffusion recipe: --dry-run prints the recipe and settings; otherwise train.
    Returns the exit status (2 for a configuration error, named)."""
    import sys

    try:
        settings = diffusion_settings(recipe, run_config)
        source = model_source(run_config, settings)
        load_prompts(run_config)
    except ValueError as err:
        print(f"stacx train: {err}", file=sys.stderr)
        return 2
    if run_config.train.dry_run:
        where = source if isinstance(source, str) else f"a new {settings.model_family} model ({settings.image_size}px)"
        print(recipe.describe())
        print(f"\nmodel: {where}\ndiffusion settings: {dataclasses.asdict(settings)}")
        return 0
    started = time.monotonic()
    run_diffusion_training(run_config, recipe)
    print(f"stacx train: {recipe.name} finished {run_config.train.num_steps} steps in {time.monotonic() - started:.0f} s; "
          f"metrics in {os.path.join(run_config.logging.out, 'metrics.jsonl')}")
    return 0
