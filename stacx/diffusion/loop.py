"""The driver loop of a diffusion recipe: `stacx train --algorithm flow_grpo` lands here through the
`image` workload (`stacx.diffusion.workload`).

    driver = DiffusionDriver(run_config, recipe)     # checks the configuration; starts nothing
    print(driver.describe())                         # --dry-run
    driver.run()                                     # Ray, the policy's workers, the steps, --save

    run = DiffusionRun(run_config, recipe)           # the live run: a DiffusionPolicyGroup on Ray workers
    for step in range(run_config.train.num_steps):
        metrics = run.train_step(step)               # sample + score + advantages + one optimizer step
    run.save(run_config.model.save); run.close()

One step of each kind (the recipe's data source and objective say which):

- sft:  the driver draws the step's prompts, renders their target images (built-in data), t and
        eps per image, splits them over the DP ranks; each rank takes one flow-matching step.
- dpo:  the same with (chosen, rejected) pairs sharing t and eps.
- grpo: prompts are split over the DP ranks (a prompt's group stays on one rank); each rank
        samples its groups with the SDE sampler and scores them; the driver turns rewards into
        group advantages with the registered estimator and each rank trains on its trajectories.
- nft:  as grpo, with ODE samples and the forward-process loss (t and eps drawn per image).
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Sequence

import torch

from stacx.diffusion.algorithm_config import DiffusionAlgorithmConfig, resolve_diffusion_algorithm
from stacx.diffusion.group import DiffusionPolicyGroup
from stacx.diffusion.prompts import COLORS, TRAIN_PROMPTS, parse_prompt, render_target
from stacx.diffusion.runtime import latent_shape, model_source
from stacx.objectives.registry import get_advantage


def refuse_model_parallelism(parallel) -> None:
    """The diffusion recipes replicate the model on every rank: tensor / context parallelism is refused."""
    for flag, value in (("--tensor-model-parallel-size", parallel.tensor_model_parallel_size),
                        ("--context-parallel-size", parallel.context_parallel_size)):
        if value != 1:
            raise ValueError(f"{flag} {value}: the diffusion recipes run data parallel only (the model is replicated "
                             f"on every rank); set {flag} 1 and scale with --data-parallel-size")


def refuse_uneven_batches(run_config) -> None:
    """Every step splits --rollout-batch-size prompts evenly over the data-parallel ranks: checked before the
    run starts, not at its first step."""
    size, dp = run_config.rollout.rollout_batch_size, run_config.parallel.data_parallel_size
    if size % dp:
        raise ValueError(f"--rollout-batch-size {size} must be divisible by --data-parallel-size {dp} (each rank "
                         f"takes an equal share of the step's prompts); use a multiple of {dp}")


def load_prompts(run_config) -> tuple[str, ...]:
    """Training prompts: --prompt-data (JSONL, --input-key) or the built-in colour / shape set."""
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
    """A diffusion recipe's live run: the policy's `DiffusionPolicyGroup` on Ray workers and the step functions."""

    def __init__(self, run_config, recipe, *, layout=None, graph=None):
        """`graph`: a running `RoleWorkerGraph` with a `policy` role to run on (kept open by `close`;
        tests run several recipes on one set of workers); None starts the recipe's own workers."""
        # Imported here: Ray is slow to import (start-up time); --dry-run never needs it.
        from stacx.trainer.cluster.ray.connect import connect_ray
        from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers

        refuse_model_parallelism(run_config.parallel)
        self.run_config, self.recipe = run_config, recipe
        self.algorithm: DiffusionAlgorithmConfig = resolve_diffusion_algorithm(recipe, run_config)
        self.prompts = load_prompts(run_config)
        self.shape = latent_shape(model_source(run_config.model.hf_checkpoint, self.algorithm))
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
        try:
            self.policy = DiffusionPolicyGroup(self.graph.workers["policy"], role, run_config, self.algorithm)
        except BaseException:
            self.close(failed=True)
            raise
        self.dp = self.policy.data_parallel_size
        self.info = self.policy.info
        self._step = self._rollout_step if recipe.data_source == "rollout" else self._dataset_step

    # ---- one step -----------------------------------------------------------------------------
    def _rng(self, step: int) -> tuple[random.Random, torch.Generator]:
        seed = self.run_config.train.seed * 100_003 + step
        return random.Random(seed), torch.Generator().manual_seed(seed)

    def _forward_noise(self, num: int, generator: torch.Generator) -> dict:
        """t ~ U(0, 1) and eps per sample, drawn by the driver so every split sees the same draws."""
        return {"t": torch.rand(num, generator=generator), "noise": torch.randn((num, *self.shape), generator=generator)}

    def train_step(self, step: int) -> dict:
        started = time.monotonic()
        metrics = self._step(step)
        metrics["step_time_s"] = time.monotonic() - started
        return metrics

    def _dataset_batch(self, step: int) -> list[dict]:
        rng, generator = self._rng(step)
        size = self.run_config.rollout.rollout_batch_size
        if size % self.dp:
            raise ValueError(f"--rollout-batch-size ({size}) must be divisible by the data-parallel size ({self.dp})")
        prompts = [rng.choice(self.prompts) for _ in range(size)]
        side = self.shape[-1]
        a = self.algorithm
        render = dict(generator=generator, color_noise=a.data_color_noise, max_offset=a.data_max_offset,
                      color_scale=a.data_color_scale)
        batch = {"prompts": prompts, **self._forward_noise(size, generator)}
        if self.kind == "sft":
            batch["images"] = torch.stack([render_target(p, side, **render) for p in prompts])
        else:  # dpo: chosen drawn in the named colour, rejected in another one, same shape and noise
            wrong = [rng.choice([c for c in COLORS if c != parse_prompt(p)[0]]) for p in prompts]
            batch["chosen"] = torch.stack([render_target(p, side, **render) for p in prompts])
            batch["rejected"] = torch.stack([render_target(p, side, color=c, generator=generator,
                                                           max_offset=a.data_max_offset)
                                             for p, c in zip(prompts, wrong)])
        parts = []
        for rank in range(self.dp):
            lo, hi = rank * size // self.dp, (rank + 1) * size // self.dp
            parts.append({k: v[lo:hi] for k, v in batch.items()})
        return parts

    def _dataset_step(self, step: int) -> dict:
        return dict(self.policy.train_on_batch(self._dataset_batch(step))[0])

    def _rollout_step(self, step: int) -> dict:
        rng, generator = self._rng(step)
        group = self.run_config.rollout.n_samples_per_prompt
        prompts = [rng.choice(self.prompts) for _ in range(self.run_config.rollout.rollout_batch_size)]
        per_rank = split_evenly(prompts, self.dp, "--rollout-batch-size")
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) for _ in range(self.dp)]
        sampled = self.policy.sample_group_rollouts(per_rank, group, step, seeds)
        rewards = torch.tensor([r for rank_rewards in sampled for r in rank_rewards], dtype=torch.float64)
        prompt_ids = [i for i in range(len(prompts)) for _ in range(group)]
        advantages = get_advantage(self.algorithm.advantage_estimator)(
            self.algorithm, {"rewards": rewards, "response_lengths": [1] * len(rewards), "prompt_id": prompt_ids})
        advantages = [float(a[0]) for a in advantages]
        per_rank_adv = split_evenly(advantages, self.dp, "the step's samples")
        noise = [None] * self.dp
        if self.kind == "nft":
            drawn = self._forward_noise(len(rewards), generator)
            noise = [{k: v[r * len(rewards) // self.dp:(r + 1) * len(rewards) // self.dp] for k, v in drawn.items()}
                     for r in range(self.dp)]
        metrics = dict(self.policy.train_on_rollout(per_rank_adv, noise)[0])
        metrics.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0)
        return metrics

    # ---- evaluation, checkpoints, teardown ------------------------------------------------------
    def evaluate(self, prompts: Sequence[str], *, seed: int = 0, num_per_prompt: int = 1) -> dict:
        """ODE samples of `prompts` (each `num_per_prompt` times, fixed noise) on rank 0; mean reward and images."""
        expanded = [p for p in prompts for _ in range(num_per_prompt)]
        result = self.policy.evaluate(expanded, seed, self.algorithm.num_inference_steps)
        return {"reward_mean": sum(result["rewards"]) / len(result["rewards"]), **result}

    def save(self, path: str) -> str:
        return self.policy.save(path)

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


class DiffusionDriver:
    """The `image` workload's driver (`stacx.trainer.config.workload.WorkloadDriver`): checks the run's
    configuration when built (ValueError naming the flag), prints it for --dry-run, trains on `run()`."""

    def __init__(self, run_config, recipe, *, log=print):
        refuse_model_parallelism(run_config.parallel)
        refuse_uneven_batches(run_config)
        self.run_config, self.recipe, self.log = run_config, recipe, log
        self.algorithm = resolve_diffusion_algorithm(recipe, run_config)
        self.source = model_source(run_config.model.hf_checkpoint, self.algorithm)
        load_prompts(run_config)

    def describe(self) -> str:
        a = self.algorithm
        where = self.source if isinstance(self.source, str) else f"a new {a.model_family} model ({a.image_size}px)"
        return f"{self.recipe.describe()}\n\nmodel: {where}\ndiffusion settings: {a.diffusion_values()}"

    def run(self) -> dict:
        started = time.monotonic()
        metrics = run_diffusion_training(self.run_config, self.recipe, log=self.log)
        self.log(f"stacx train: {self.recipe.name} finished {self.run_config.train.num_steps} steps in "
                 f"{time.monotonic() - started:.0f} s; metrics in "
                 f"{os.path.join(self.run_config.logging.out, 'metrics.jsonl')}")
        return metrics
