"""How the training loop reaches a role's ranks: the `RoleGroup` and `Channel` protocols.

The loop (`StacxTrainer`) calls typed methods; each runs the same-named `RoleRuntime` method on
every rank of the role at once and returns one result per rank (rank order):

    group.layout / group.coords            the role's (tp, cp, dp) layout; each rank's RankCoords
    group.train_step(shards, counts, norm_length) -> per-rank metrics
    group.compute_fields(shards, names)    -> per-rank forward-only fields
    group.push_weights(kind, url, version, bucket_bytes, api_key) -> per-rank tensors sent
    group.save(staging_dir) / group.load(loaded) / group.export_hf(out_dir)
    channel.is_driver / channel.share(value) / channel.barrier()

`shards` holds one list of micro-batches per rank (TP and CP peers of a DP rank get the same).
Implementations: `stacx.trainer.cluster.local` (the processes of a torchrun job) and
`stacx.trainer.cluster.ray` (Ray actors). A test can drive the loop with any object that has
these methods.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from stacx.parallel.reduction import StepCounts
from stacx.trainer.batch import StepBatch
from stacx.trainer.checkpoint import LoadedCheckpoint, RankFileInfo
from stacx.trainer.config.layout import RankCoords, RoleLayout

MicroBatches = Sequence[StepBatch]
"""One rank's micro-batches (each a `StepBatch` of its samples, see `stacx.trainer.batch`)."""


class RoleGroup(Protocol):
    """Every rank of one role, called collectively; each method returns one result per rank."""

    name: str
    layout: RoleLayout
    coords: list[RankCoords]
    """Per rank (rank order): where it sits in the role's (tp, cp, dp) grid."""

    def train_step(self, shards: Sequence[MicroBatches], counts: StepCounts,
                   norm_length: float | None) -> list[dict[str, float]]:
        """One optimizer step; `shards[rank]` is that rank's micro-batches. Metrics are alike on every rank."""
        ...

    def compute_fields(self, shards: Sequence[MicroBatches], names: Sequence[str]) -> list[list[dict] | None]:
        """Forward-only per-sample fields (`COMPUTABLE_FIELDS`) of each rank's micro-batches."""
        ...

    def push_weights(self, engine_kind: str, url: str, version: int, bucket_bytes: int,
                     api_key: str | None, check_weights: bool = False, *,
                     weight_transfer: str | None = None) -> list[int]:
        """Stream the role's weights to the inference server at `url`; tensors sent per rank. check_weights:
        then compare the engine's per-tensor digests with the sent ones (stacx.rollout.weight_check).
        weight_transfer: how the weights travel, for a kind that offers a choice (`EngineTarget.push_options`;
        passed only when set)."""
        ...

    def save(self, staging_dir: str) -> list[RankFileInfo]:
        """Write every rank's state into a checkpoint staging folder."""
        ...

    def load(self, loaded: LoadedCheckpoint) -> None:
        """Load every rank's state from a checkpoint (remapped when cp or dp changed)."""
        ...

    def export_hf(self, out_dir: str) -> None:
        """Write the role's model as a Hugging Face checkpoint."""
        ...

    def load_start_weights(self, path: str) -> None:
        """Load a Hugging Face or torch_dist model folder as the role's weights (a fresh run's `--load`)."""
        ...


class ExchangeGroup(Protocol):
    """A connected exchange sync between two roles (Ray only): moves the named payloads bit for bit."""

    name: str

    def transfer_payloads(self, keys: Sequence[str], *, sources_by_target: Sequence[int]) -> list[dict[str, int]]:
        """Run the keys' `ExchangePayload`s; per target rank, {key: tensors consumed}."""
        ...


class Channel(Protocol):
    """How the driving process shares values with the others (a no-op on Ray, where only the driver runs the loop)."""

    is_driver: bool

    def share(self, value: Any) -> Any:
        """The driver's `value`, on every process."""
        ...

    def barrier(self) -> None:
        ...
