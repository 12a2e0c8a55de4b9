"""`DiffusionPolicyGroup`: the typed interface of a diffusion policy's Ray workers, one
`DiffusionRuntime` on each (the diffusion counterpart of `stacx.trainer.cluster.ray.group.RayRoleGroup`).

    group = DiffusionPolicyGroup(workers, role, run_config, algorithm)    # builds a runtime per rank
    rewards = group.sample_group_rollouts(prompts_per_rank, group_size, step, seeds)
    metrics = group.train_on_rollout(advantages_per_rank, noise_per_rank)  # one optimizer step
    metrics = group.train_on_batch(batch_per_rank)
    group.evaluate(prompts, seed, num_steps); group.save(path); group.parameter_checksums()

Each method ships a module-level function of this file to the workers (`RoleWorkers.execute_*`);
the function finds the rank's runtime in `worker.state` and makes the plain method call. Per-rank
arguments are sequences in rank order; results come back in rank order.
"""

from __future__ import annotations

from typing import Any, Sequence

from stacx.diffusion.algorithm_config import DiffusionAlgorithmConfig
from stacx.diffusion.runtime import DiffusionRuntime
from stacx.trainer.cluster.ray.role_worker import RoleWorker
from stacx.trainer.cluster.ray.role_workers import RoleWorkers
from stacx.trainer.config.recipe import ModelRole
from stacx.trainer.config.run import RunConfig

RUNTIME_KEY = "diffusion_runtime"
"""Where a worker keeps its rank's `DiffusionRuntime` (`worker.state[RUNTIME_KEY]`)."""


# ---- functions run on the workers ---------------------------------------------------------------


def runtime_of(worker: RoleWorker) -> DiffusionRuntime:
    """The `DiffusionRuntime` built on this worker by `DiffusionPolicyGroup`."""
    runtime = worker.state.get(RUNTIME_KEY)
    if runtime is None:
        raise RuntimeError(f"role {worker.role_name!r} rank {worker.rank}: no diffusion runtime built "
                           "(DiffusionPolicyGroup first)")
    return runtime


def _build_runtime(worker: RoleWorker, role: ModelRole, run_config: RunConfig,
                   algorithm: DiffusionAlgorithmConfig) -> dict[str, Any]:
    worker.state[RUNTIME_KEY] = DiffusionRuntime(role, run_config, algorithm, worker.groups, rank=worker.rank)
    return worker.state[RUNTIME_KEY].describe()


def _sample_group_rollouts(worker: RoleWorker, prompts: Sequence[str], group_size: int, step: int,
                           seed: int) -> list[float]:
    return runtime_of(worker).sample_group_rollouts(prompts, group_size, step, seed)


def _train_on_rollout(worker: RoleWorker, advantages: Sequence[float], forward_noise: dict | None) -> dict:
    return runtime_of(worker).train_on_rollout(advantages, forward_noise)


def _train_on_batch(worker: RoleWorker, batch: dict) -> dict:
    return runtime_of(worker).train_on_batch(batch)


def _evaluate_prompts(worker: RoleWorker, prompts: Sequence[str], seed: int, num_steps: int) -> dict:
    return runtime_of(worker).evaluate_prompts(prompts, seed, num_steps)


def _save_policy(worker: RoleWorker, path: str) -> str | None:
    return runtime_of(worker).save_policy(path)


def _parameter_checksum(worker: RoleWorker) -> float:
    return runtime_of(worker).parameter_checksum()


# ---- the driver side ------------------------------------------------------------------------------


class DiffusionPolicyGroup:
    """Every rank of a diffusion policy role, called collectively through typed methods."""

    def __init__(self, workers: RoleWorkers, role: ModelRole, run_config: RunConfig,
                 algorithm: DiffusionAlgorithmConfig):
        """Build a `DiffusionRuntime` on every worker (replacing one a previous run left there)."""
        if workers.tensor_model_parallel_size != 1 or workers.context_parallel_size != 1:
            raise ValueError(f"role {role.name!r}: the diffusion recipes run data parallel only; the workers have "
                             f"tp={workers.tensor_model_parallel_size} cp={workers.context_parallel_size}")
        self.name = role.name
        self.workers = workers
        self.data_parallel_size = workers.data_parallel_size
        self.info: dict[str, Any] = workers.execute_all(_build_runtime, role, run_config, algorithm)[0]
        """Rank 0's `DiffusionRuntime.describe()`: parameter count, whether a reference was built."""

    @classmethod
    def on_built_workers(cls, workers: RoleWorkers) -> "DiffusionPolicyGroup":
        """The group over workers whose runtimes a previous group built (a finished run on shared workers:
        tests read its replicas' checksums); builds nothing."""
        group = cls.__new__(cls)
        group.name, group.workers, group.data_parallel_size = workers.role_name, workers, workers.data_parallel_size
        group.info = {}
        return group

    def _per_rank(self, what: str, values: Sequence) -> Sequence:
        if len(values) != self.data_parallel_size:
            raise ValueError(f"{what}: {len(values)} entries for {self.data_parallel_size} data-parallel ranks")
        return values

    def sample_group_rollouts(self, prompts: Sequence[Sequence[str]], group_size: int, step: int,
                              seeds: Sequence[int]) -> list[list[float]]:
        """Each rank samples `group_size` images of each of its prompts (`prompts[rank]`, seed `seeds[rank]`);
        per rank, the rewards (prompt-major)."""
        self._per_rank("prompts", prompts)
        return self.workers.execute_per_rank(_sample_group_rollouts, [
            (list(part), group_size, step, seed) for part, seed in zip(prompts, self._per_rank("seeds", seeds))])

    def train_on_rollout(self, advantages: Sequence[Sequence[float]],
                         forward_noise: Sequence[dict | None]) -> list[dict[str, float]]:
        """One optimizer step of every rank on its kept rollout; per-rank metrics (alike on every rank)."""
        self._per_rank("forward_noise", forward_noise)
        return self.workers.execute_per_rank(_train_on_rollout, [
            (list(part), noise) for part, noise in zip(self._per_rank("advantages", advantages), forward_noise)])

    def train_on_batch(self, batches: Sequence[dict]) -> list[dict[str, float]]:
        """One optimizer step of every rank on its batch (`batches[rank]`); per-rank metrics."""
        return self.workers.execute_per_rank(_train_on_batch, [(batch,) for batch in self._per_rank("batches", batches)])

    def evaluate(self, prompts: Sequence[str], seed: int, num_steps: int) -> dict:
        """ODE samples of `prompts` on rank 0 from fixed noise: {"rewards", "images"}."""
        return self.workers.execute_rank0(_evaluate_prompts, list(prompts), seed, num_steps)

    def save(self, path: str) -> str:
        """Rank 0 writes the policy in the diffusers layout; returns the folder."""
        return self.workers.execute_all(_save_policy, path)[0]

    def parameter_checksums(self) -> list[float]:
        """Per rank, the sum of every parameter (replicas must agree)."""
        return self.workers.execute_all(_parameter_checksum)
