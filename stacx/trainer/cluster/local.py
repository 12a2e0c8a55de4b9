"""The one role of a torchrun job: every process runs the loop and is one rank of the role.

A call runs the method on this process's `RoleRuntime` and all-gathers the results, so every
process sees every rank's result. Values travel as `rank_messages` (JSON plus raw tensor bytes),
never as pickles: a process that reached the job's connections cannot make a rank unpickle (run)
anything. Rank 0 drives: its values (the step's samples, a checkpoint's staging folder) are
broadcast to the other ranks by `TorchrunChannel.share`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.distributed as dist

from stacx.parallel.reduction import StepCounts
from stacx.trainer.checkpoint import LoadedCheckpoint, RankFileInfo
from stacx.trainer.cluster.protocol import MicroBatches
from stacx.trainer.runtime.push_outcome import push_outcome, settle_push
from stacx.trainer.cluster.rank_messages import all_gather_values, broadcast_value
from stacx.trainer.config.layout import RankCoords, RoleLayout
from stacx.trainer.runtime.role_runtime import RoleRuntime


class LocalRoleGroup:
    """A `RoleGroup` whose ranks are the processes of this torchrun job; this one is `dist.get_rank()`."""

    fails_together = True
    """A failed weight push raises the same error on every rank (the loop may then retry it on every rank)."""

    def __init__(self, runtime: RoleRuntime, name: str):
        self.name = name
        self.runtime = runtime
        groups = runtime.groups
        self.rank = dist.get_rank()
        self.layout = RoleLayout(tensor_model_parallel_size=groups.tp_size, context_parallel_size=groups.cp_size,
                                 pipeline_model_parallel_size=groups.pp_size, data_parallel_size=groups.dp_size,
                                 expert_model_parallel_size=groups.ep_size, expert_tensor_parallel_size=groups.etp_size)
        self.coords = [RankCoords(**c) for c in all_gather_values(dataclasses.asdict(RankCoords.of(groups)))]

    def train_step(self, shards: Sequence[MicroBatches], counts: StepCounts,
                   norm_length: float | None) -> list[dict[str, float]]:
        return all_gather_values(self.runtime.train_step(shards[self.rank], counts, norm_length))

    def compute_fields(self, shards: Sequence[MicroBatches], names: Sequence[str]) -> list:
        return all_gather_values(self.runtime.compute_fields(shards[self.rank], names))

    def push_weights(self, engine_kind: str, url: str, version: int, bucket_bytes: int,
                     api_key: str | None, check_weights: bool = False, *,
                     weight_transfer: str | None = None) -> list[int]:
        # every rank raises alike when one failed (a retry needs every rank; stacx.trainer.runtime.push_outcome)
        outcome = push_outcome(lambda: self.runtime.push_weights_to_engine(engine_kind, url, version, bucket_bytes,
                                                                           api_key, check_weights=check_weights,
                                                                           weight_transfer=weight_transfer))
        return settle_push(all_gather_values(outcome), url=url)

    def save(self, staging_dir: str) -> list[RankFileInfo]:
        return all_gather_values(self.runtime.save_rank_state(staging_dir, self.name, self.rank))

    def load(self, loaded: LoadedCheckpoint) -> None:
        self.runtime.load_rank_state(loaded, self.name, self.rank)
        dist.barrier()

    def export_hf(self, out_dir: str) -> None:
        self.runtime.export_hf(out_dir)
        dist.barrier()

    def load_start_weights(self, path: str) -> None:
        self.runtime.load_start_weights(path)
        dist.barrier()


class TorchrunChannel:
    """Rank 0 drives; `share` broadcasts its value to every rank."""

    def __init__(self):
        self.is_driver = dist.get_rank() == 0

    def share(self, value: Any) -> Any:
        return broadcast_value(value, src=0)  # JSON and raw tensor bytes, never pickle

    def barrier(self) -> None:
        dist.barrier()
