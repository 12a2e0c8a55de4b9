"""A third-party workload, as a package would ship it behind a `stacx.workloads` entry point: the `points`
modality (fit a vector to target points by gradient descent) with its driver loop, objective base,
per-rank runtime and one recipe, `toy_points_fit`. Importing the module registers both."""

from __future__ import annotations

import json
import os

import torch

from stacx.parallel.groups import ProcessGroups
from stacx.trainer.config.recipe import ModelRole, TrainingConfig, recipe
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.trainer.config.workload import Workload, register_workload

TARGET = torch.tensor([1.0, -2.0, 0.5])


class PointsObjective:
    """The toy modality's own objective base (not a Specialization)."""

    def loss(self, weight: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
        return ((points - weight) ** 2).sum(dim=1).mean()


class MeanSquaredDistance(PointsObjective):
    pass


class PointsRuntime:
    """One rank: the weight vector, its learning rate and the role's objective (plain gradient descent:
    a torch optimizer's first step imports torch._dynamo, seconds of a cheap test)."""

    def __init__(self, role, run_config, algorithm, groups: ProcessGroups, *, rank: int = 0):
        self.rank, self.groups = rank, groups
        self.weight = torch.zeros(len(TARGET), requires_grad=True)
        self.objective = role.specialization_cls()
        self.lr = run_config.optim.lr

    def train_step(self, points: torch.Tensor) -> float:
        loss = self.objective.loss(self.weight, points)
        (grad,) = torch.autograd.grad(loss, [self.weight])
        with torch.no_grad():
            self.weight -= self.lr * grad
        return float(loss.detach())


class PointsDriver:
    """In-process driver: one rank, `--num-steps` steps of `--rollout-batch-size` noisy target points."""

    def __init__(self, run_config, recipe):
        if run_config.rollout.rollout_batch_size < 2:
            raise ValueError(f"--rollout-batch-size {run_config.rollout.rollout_batch_size}: the points workload "
                             "needs at least 2 points per step")
        self.run_config, self.recipe = run_config, recipe

    def describe(self) -> str:
        return f"points workload: {self.recipe.name}, {self.run_config.train.num_steps} steps"

    def run(self) -> dict:
        algorithm = resolve_algorithm_config(self.recipe, self.run_config)
        runtime = POINTS_WORKLOAD.runtime(self.recipe.role("policy"), self.run_config, algorithm,
                                          ProcessGroups.single_process(), rank=0)
        generator = torch.Generator().manual_seed(self.run_config.train.seed)
        out = self.run_config.logging.out
        os.makedirs(out, exist_ok=True)
        metrics = {}
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            for step in range(self.run_config.train.num_steps):
                size = self.run_config.rollout.rollout_batch_size
                points = TARGET + 0.01 * torch.randn(size, len(TARGET), generator=generator)
                metrics = {"loss": runtime.train_step(points)}
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        return metrics


POINTS_WORKLOAD = register_workload(Workload(modality="points", description="toy points (tests)", driver=PointsDriver,
                                             objective_base=PointsObjective, runtime=PointsRuntime))


@recipe("toy_points_fit")
def toy_points_fit() -> TrainingConfig:
    return TrainingConfig(name="toy_points_fit", description="Fit a vector to target points (a test workload).",
                          roles=(ModelRole(name="policy", specialization_cls=MeanSquaredDistance),),
                          data_source="dataset", modality="points")
