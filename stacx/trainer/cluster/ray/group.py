"""`RayRoleGroup`: a role's Ray workers (`RoleWorkers`), each holding one `RoleRuntime`.

Each typed method ships a module-level function of this file to every worker
(`RoleWorkers.execute_per_rank`); the function finds the rank's runtime in `worker.state` and
makes the plain method call. The Ray driver is the only process running the loop (`RayChannel`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.parallel.reduction import StepCounts
from stacx.trainer.checkpoint import LoadedCheckpoint, RankFileInfo
from stacx.trainer.cluster.protocol import MicroBatches
from stacx.trainer.cluster.ray.role_worker import RoleWorker
from stacx.trainer.cluster.ray.role_workers import RoleWorkers
from stacx.trainer.config.layout import RankCoords, RoleLayout
from stacx.trainer.config.recipe import ModelRole
from stacx.trainer.config.run import RunConfig
from stacx.trainer.runtime.exchange_payloads import consume_payloads, produce_payloads
from stacx.trainer.runtime.role_runtime import RoleRuntime

RUNTIME_KEY = "runtime"
"""Where a worker keeps its rank's `RoleRuntime` (`worker.state[RUNTIME_KEY]`)."""


# ---- functions run on the workers ---------------------------------------------------------------


def runtime_of(worker: RoleWorker) -> RoleRuntime:
    """The `RoleRuntime` built on this worker by `RayRoleGroup`."""
    runtime = worker.state.get(RUNTIME_KEY)
    if runtime is None:
        raise RuntimeError(f"role {worker.role_name!r} rank {worker.rank}: no runtime built (RayRoleGroup first)")
    return runtime


def _build_runtime(worker: RoleWorker, role: ModelRole, run_config: RunConfig,
                   algorithm: AlgorithmConfig) -> RankCoords:
    worker.state[RUNTIME_KEY] = RoleRuntime(role, algorithm, worker.groups, model=run_config.model,
                                            optim=run_config.optim, train=run_config.train, rank=worker.rank)
    return RankCoords.of(worker.groups)


def _train_step(worker: RoleWorker, micro_batches: MicroBatches, counts: StepCounts, norm_length: float | None) -> dict:
    return runtime_of(worker).train_step(micro_batches, counts, norm_length)


def _compute_fields(worker: RoleWorker, micro_batches: MicroBatches, names: Sequence[str]):
    return runtime_of(worker).compute_fields(micro_batches, names)


def _push_weights(worker: RoleWorker, engine_kind: str, url: str, version: int, bucket_bytes: int,
                  api_key: str | None, check_weights: bool = False, weight_transfer: str | None = None) -> int:
    return runtime_of(worker).push_weights_to_engine(engine_kind, url, version, bucket_bytes, api_key,
                                                     check_weights=check_weights, weight_transfer=weight_transfer)


def _save(worker: RoleWorker, staging_dir: str) -> RankFileInfo:
    return runtime_of(worker).save_rank_state(staging_dir, worker.role_name, worker.rank)


def _load(worker: RoleWorker, loaded: LoadedCheckpoint) -> None:
    runtime_of(worker).load_rank_state(loaded, worker.role_name, worker.rank)


def _export_hf(worker: RoleWorker, out_dir: str) -> None:
    runtime_of(worker).export_hf(out_dir)


def _load_start_weights(worker: RoleWorker, path: str) -> None:
    runtime_of(worker).load_start_weights(path)


def produce_on_worker(worker: RoleWorker, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """An exchange's source side: every key's tensors from this rank's runtime."""
    return produce_payloads(runtime_of(worker), keys)


def consume_on_worker(worker: RoleWorker, tensors: Mapping[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, int]:
    """An exchange's target side: hand each key its tensors on this rank's runtime."""
    return consume_payloads(runtime_of(worker), tensors, keys)


# ---- the driver side ------------------------------------------------------------------------------


class RayRoleGroup:
    """A `RoleGroup` over one role's Ray workers, with a `RoleRuntime` built on each."""

    def __init__(self, workers: RoleWorkers, role: ModelRole, run_config: RunConfig, algorithm: AlgorithmConfig):
        self.name = role.name
        self.workers = workers
        self.layout = RoleLayout(tensor_model_parallel_size=workers.tensor_model_parallel_size,
                                 context_parallel_size=workers.context_parallel_size,
                                 pipeline_model_parallel_size=workers.pipeline_model_parallel_size,
                                 data_parallel_size=workers.data_parallel_size,
                                 expert_model_parallel_size=workers.expert_model_parallel_size,
                                 expert_tensor_parallel_size=workers.expert_tensor_parallel_size)
        self.coords: list[RankCoords] = workers.execute_all(_build_runtime, role, run_config, algorithm)

    def train_step(self, shards: Sequence[MicroBatches], counts: StepCounts,
                   norm_length: float | None) -> list[dict[str, float]]:
        return self.workers.execute_per_rank(_train_step, [(shard, counts, norm_length) for shard in shards])

    def compute_fields(self, shards: Sequence[MicroBatches], names: Sequence[str]) -> list:
        return self.workers.execute_per_rank(_compute_fields, [(shard, names) for shard in shards])

    def push_weights(self, engine_kind: str, url: str, version: int, bucket_bytes: int,
                     api_key: str | None, check_weights: bool = False, *,
                     weight_transfer: str | None = None) -> list[int]:
        return self.workers.execute_all(_push_weights, engine_kind, url, version, bucket_bytes, api_key, check_weights,
                                        weight_transfer)

    def save(self, staging_dir: str) -> list[RankFileInfo]:
        return self.workers.execute_all(_save, staging_dir)

    def load(self, loaded: LoadedCheckpoint) -> None:
        self.workers.execute_all(_load, loaded)

    def export_hf(self, out_dir: str) -> None:
        self.workers.execute_all(_export_hf, out_dir)

    def load_start_weights(self, path: str) -> None:
        self.workers.execute_all(_load_start_weights, path)


class RayChannel:
    """The Ray driver is the only process running the loop."""

    is_driver = True
    drives_alone = True
    """No other process runs the loop: the driver may decide alone mid-collective (a weight push's retry)."""

    def share(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        pass
