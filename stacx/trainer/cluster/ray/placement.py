"""Resource pools: one Ray placement group per pool, one bundle per rank, shared by colocated roles.

A pool reserves `num_bundles` bundles (each `num_cpus_per_bundle` CPUs, `num_gpus_per_bundle`
GPUs and any custom resources). Rank `i` of every role placed on the pool runs in bundle `i`.
Roles that share a pool therefore sit on the same devices and time-share them: each of the
`num_sharing_roles` actors in a bundle asks for `1 / num_sharing_roles` of it (fractional CPUs
and GPUs), so the placement group holds all of them at once and Ray never oversubscribes it.

Custom resources place bundles on chosen nodes: a cluster started with
`ray start --resources='{"node_a": 2}'` on one node and `'{"node_b": 2}'` on another, and a
pool with `bundle_resources=({"node_a": 1}, {"node_b": 1})`, puts rank 0 on the first node
and rank 1 on the second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class ResourcePool:
    """What one pool reserves. Validated on construction; errors name the pool and field."""

    name: str
    """Pool name (a role's `pool`, or the pool of the role it shares with)."""
    num_bundles: int
    """Bundles in the placement group; a role on this pool may use at most this many ranks."""
    num_cpus_per_bundle: float = 1.0
    """CPUs per bundle, split evenly between the roles sharing the pool."""
    num_gpus_per_bundle: float = 0.0
    """GPUs per bundle (1 on GPU clusters), split evenly between the roles sharing the pool."""
    bundle_resources: tuple[Mapping[str, float], ...] = ()
    """Extra custom resources of each bundle (empty, or one mapping per bundle) - e.g. to pin
    bundles to nodes started with matching `--resources`."""
    strategy: str = "PACK"
    """Ray placement strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""

    def __post_init__(self) -> None:
        where = f"resource pool {self.name!r}"
        if not self.name:
            raise ValueError("resource pool: field 'name' must be a non-empty string")
        if self.num_bundles < 1:
            raise ValueError(f"{where}: field 'num_bundles' must be >= 1, got {self.num_bundles}")
        if self.num_cpus_per_bundle < 0 or self.num_gpus_per_bundle < 0:
            raise ValueError(
                f"{where}: fields 'num_cpus_per_bundle' ({self.num_cpus_per_bundle}) and "
                f"'num_gpus_per_bundle' ({self.num_gpus_per_bundle}) must be >= 0"
            )
        if self.num_cpus_per_bundle == 0 and self.num_gpus_per_bundle == 0:
            # An actor that asks for nothing is not held to its bundle's node by Ray's scheduler.
            raise ValueError(f"{where}: a bundle must reserve CPUs or GPUs (num_cpus_per_bundle or num_gpus_per_bundle > 0)")
        if self.bundle_resources and len(self.bundle_resources) != self.num_bundles:
            raise ValueError(
                f"{where}: field 'bundle_resources' has {len(self.bundle_resources)} entries, "
                f"expected one per bundle ({self.num_bundles})"
            )
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"{where}: field 'strategy' is {self.strategy!r}; known: {list(PLACEMENT_STRATEGIES)}")

    def bundles(self) -> list[dict[str, float]]:
        """The Ray bundle dicts, in bundle (= rank) order."""
        bundles = []
        for index in range(self.num_bundles):
            bundle: dict[str, float] = {}
            if self.num_cpus_per_bundle:
                bundle["CPU"] = float(self.num_cpus_per_bundle)
            if self.num_gpus_per_bundle:
                bundle["GPU"] = float(self.num_gpus_per_bundle)
            if self.bundle_resources:
                bundle.update({key: float(value) for key, value in self.bundle_resources[index].items()})
            bundles.append(bundle)
        return bundles


@dataclass
class PlacedPool:
    """A `ResourcePool` whose placement group exists in the cluster."""

    pool: ResourcePool
    placement_group: Any
    """The `ray.util.placement_group.PlacementGroup`."""
    num_sharing_roles: int = 1
    """How many roles' actors sit in each bundle; each takes 1/num_sharing_roles of it."""

    @classmethod
    def create(cls, pool: ResourcePool, *, num_sharing_roles: int = 1, timeout_s: float = 120.0) -> "PlacedPool":
        """Reserve the pool's bundles, failing with the pool's needs when the cluster cannot fit them."""
        # Imported here: Ray is slow to import (start-up time).
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if num_sharing_roles < 1:
            raise ValueError(f"resource pool {pool.name!r}: num_sharing_roles must be >= 1, got {num_sharing_roles}")
        group = placement_group(pool.bundles(), strategy=pool.strategy, name=f"stacx-pool-{pool.name}-{time.time_ns()}")
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            raise TimeoutError(
                f"resource pool {pool.name!r} could not be placed within {timeout_s:.0f}s: it needs "
                f"{pool.num_bundles} bundles {pool.bundles()} with strategy {pool.strategy}, the cluster has "
                f"{ray.available_resources()} available"
            )
        return cls(pool=pool, placement_group=group, num_sharing_roles=num_sharing_roles)

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options placing `rank` in bundle `rank` with its share of the bundle."""
        # Imported here: Ray is slow to import (start-up time).
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= rank < self.pool.num_bundles:
            raise ValueError(
                f"resource pool {self.pool.name!r} has {self.pool.num_bundles} bundles; rank {rank} does not fit"
            )
        share = 1.0 / self.num_sharing_roles
        options: dict[str, Any] = {
            "num_cpus": self.pool.num_cpus_per_bundle * share,
            "num_gpus": self.pool.num_gpus_per_bundle * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=True,
            ),
        }
        return options

    def remove(self) -> None:
        """Release the placement group (actors in it must be gone or they are killed by Ray)."""
        # Imported here: Ray is slow to import (start-up time).
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - the cluster may already be gone at teardown
            pass


@dataclass(frozen=True)
class RolePlacement:
    """Where one role's ranks go: a placed pool (rank i -> bundle i)."""

    pool: PlacedPool
    extra_actor_options: Mapping[str, Any] = field(default_factory=dict)
    """Merged into each actor's options (e.g. `runtime_env`)."""

    def actor_options(self, rank: int) -> dict[str, Any]:
        return {**self.pool.actor_options(rank), **dict(self.extra_actor_options)}
