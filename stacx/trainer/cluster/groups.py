"""How the training loop reaches a role's ranks: Ray actors, or the processes of a torchrun job.

The loop (`StacxTrainer`) only uses this small surface:

    group.coords                           per rank: {"tp_rank", "cp_rank", "dp_rank"}
    group.call("train_step", args_per_rank) -> per-rank results (RoleRuntime methods)
    channel.is_driver / channel.share(value) / channel.barrier()

- `RayRoleGroup`: the driver ships `call_runtime` to every `RoleWorker` of the role.
- `LocalRoleGroup` (torchrun): every process runs the loop; a call runs the method on this
  process's runtime and all-gathers the results, so every process sees every rank's result.
- `RayChannel` / `TorchrunChannel`: the driver is the Ray driver, or rank 0 of torchrun, whose
  values (the step's samples, a checkpoint's staging folder) are broadcast to the other ranks.

On torchrun, values travel as `rank_messages` (JSON plus raw tensor bytes), never as pickles: a
process that reached the job's connections cannot make a rank unpickle (run) anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class RoleLayout:
    """One role's resolved parallel layout (the factory resolves it; the loop plans micro-batches by it)."""

    tensor_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size * self.data_parallel_size


class RayRoleGroup:
    """A role's Ray workers (`RoleWorkers`) with a RoleRuntime built on each."""

    def __init__(self, workers, role, run_config, algorithm):
        from stacx.trainer.runtime.calls import build_runtime

        self.name = role.name
        self.workers = workers
        self.layout = RoleLayout(workers.tensor_parallel_size, workers.context_parallel_size, workers.data_parallel_size)
        self.coords = workers.execute_all(build_runtime, role, run_config, algorithm)

    def call(self, method: str, args_per_rank: Sequence[tuple]) -> list:
        from stacx.trainer.runtime.calls import call_runtime

        return self.workers.execute_per_rank(call_runtime, [(method, *args) for args in args_per_rank])

    def call_all(self, method: str, *args) -> list:
        return self.call(method, [args] * self.layout.num_ranks)


class LocalRoleGroup:
    """The one role of a torchrun job: this process is rank `dist.get_rank()` of it."""

    def __init__(self, runtime, name: str):
        import torch.distributed as dist

        self.name = name
        self.runtime = runtime
        groups = runtime.groups
        self.rank = dist.get_rank()
        self.layout = RoleLayout(groups.tp_size, groups.cp_size, groups.dp_size)
        self.coords = self._gather({"tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank, "dp_rank": groups.dp_rank})

    @staticmethod
    def _gather(value) -> list:
        from stacx.trainer.cluster.rank_messages import all_gather_values

        return all_gather_values(value)  # JSON and raw tensor bytes, never pickle

    def call(self, method: str, args_per_rank: Sequence[tuple]) -> list:
        return self._gather(getattr(self.runtime, method)(*args_per_rank[self.rank]))

    def call_all(self, method: str, *args) -> list:
        return self._gather(getattr(self.runtime, method)(*args))


class RayChannel:
    """The Ray driver is the only process running the loop."""

    is_driver = True

    def share(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        pass


class TorchrunChannel:
    """Rank 0 drives; `share` broadcasts its value to every rank."""

    def __init__(self):
        import torch.distributed as dist

        self.is_driver = dist.get_rank() == 0

    def share(self, value: Any) -> Any:
        from stacx.trainer.cluster.rank_messages import broadcast_value

        return broadcast_value(value, src=0)  # JSON and raw tensor bytes, never pickle

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()
