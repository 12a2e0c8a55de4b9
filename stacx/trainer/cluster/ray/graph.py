"""From a recipe to running workers: one `RoleWorkers` group per role, exchange syncs connected.

    graph = create_role_workers(training_config, WorkerLayout(data_parallel_size=1))
    graph.workers["actor"].execute_all(build_model, ...)
    graph.exchanges["actor_to_critic"].transfer(produce, consume)
    graph.shutdown()

A graph outlives a run when the run is given it (`create_trainer(run_config, graph=graph)`: sweeps,
notebooks, tests running several recipes): `prepare_run` checks that the run's roles and layouts are
the graph's, empties every worker (`RoleWorker.clear_for_next_run`) and sets the roles up again, so the
run starts as on fresh workers, without paying their process start.

Pools: every pool of `training_config.role_graph()` becomes one placement group of
`max(tp * cp over its roles) * data_parallel_size` bundles. The roles colocated on it each take
an equal share of every bundle and each uses all bundles: a role's tp and cp come from the role
(run flags may override them for trainable roles) and its dp fills the pool
(`resolve_role_layouts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from stacx.plugins.discovery import user_module_sources
from stacx.trainer.cluster.ray.exchange import ExchangeSyncGroup
from stacx.trainer.config.layout import RoleLayout
from stacx.trainer.config.recipe import TrainingConfig
from stacx.trainer.cluster.ray.placement import PlacedPool, ResourcePool, RolePlacement
from stacx.trainer.cluster.ray.role_worker import RoleWorker
from stacx.trainer.cluster.ray.role_workers import RoleWorkers, wait_all

MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class WorkerLayout:
    """How roles map onto the cluster (the Ray side of the run's parallel settings)."""

    data_parallel_size: int = 1
    """Data-parallel degree of the largest model-parallel role of each pool; a pool has
    max(tp * cp) * data_parallel_size bundles and its other roles fill them with more dp."""
    tensor_model_parallel_size: int | None = None
    """Tensor-parallel degree of every trainable role; None keeps each role's own default."""
    context_parallel_size: int | None = None
    """Context-parallel degree of every trainable role; None keeps each role's own default."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel degree of every trainable role (frozen roles keep one stage)."""
    expert_model_parallel_size: int = 1
    """Ranks each trainable role spreads a mixture-of-experts model's routed experts over (frozen roles keep
    every expert on every rank); megatron lays this expert grid over the role's own ranks, so it adds none."""
    expert_tensor_parallel_size: int | None = None
    """Ranks sharding each expert's width in trainable roles; None: the role's tensor-parallel size."""
    num_cpus_per_rank: float = 1.0
    """CPUs per bundle (one bundle per rank), split between the roles colocated on it."""
    num_gpus_per_rank: float = 0.0
    """GPUs per bundle (1 on GPU clusters), split between the roles colocated on it."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective inside a role and in exchange groups."""
    call_timeout_s: float | None = None
    """Deadline of every driver call on workers; None: calls end early only on death or error."""
    placement_strategy: str = "PACK"
    """Ray placement strategy of every pool (SPREAD to spread ranks over nodes)."""
    pool_bundle_resources: Mapping[str, tuple[Mapping[str, float], ...]] = field(default_factory=dict)
    """Per pool, custom resources of each bundle (pins ranks to nodes started with `--resources`)."""
    worker_env_vars: Mapping[str, str] = field(default_factory=dict)
    """Environment variables set in every worker process."""

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"worker layout: field 'data_parallel_size' must be >= 1, got {self.data_parallel_size}")
        if self.expert_model_parallel_size < 1:
            raise ValueError("worker layout: field 'expert_model_parallel_size' must be >= 1, "
                             f"got {self.expert_model_parallel_size}")
        if self.pipeline_model_parallel_size < 1:
            raise ValueError("worker layout: field 'pipeline_model_parallel_size' must be >= 1, "
                             f"got {self.pipeline_model_parallel_size}")
        for name in ("tensor_model_parallel_size", "context_parallel_size", "expert_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"worker layout: field {name!r} must be >= 1 or None, got {value}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"worker layout: field 'collective_timeout_s' must be > 0, got {self.collective_timeout_s}")

    @classmethod
    def from_parallel_section(cls, section: Any, **overrides) -> "WorkerLayout":
        """Build from the run config's `parallel` section (stacx.trainer.config.run.ParallelSection)."""
        values = {field: getattr(section, field) for field in PARALLEL_SECTION_FIELDS}
        return cls(**{**values, **overrides})


PARALLEL_SECTION_FIELDS = ("data_parallel_size", "tensor_model_parallel_size", "context_parallel_size",
                           "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                           "num_cpus_per_rank", "num_gpus_per_rank", "collective_timeout_s")
"""The `WorkerLayout` fields the run config's `parallel` section sets."""


def resolve_role_layouts(training_config: TrainingConfig, layout: WorkerLayout) -> dict[str, RoleLayout]:
    """(tp, cp, pp, dp, ep, etp) of every role.

    tp and cp come from the role, with the layout's overrides applied to trainable roles (pp, ep and etp
    too: frozen roles keep one stage and every expert on every rank). A pool has `max(tp * cp * pp over its roles) * data_parallel_size`
    bundles, and every role on the pool uses all of them (colocated roles time-share the same
    devices), so a role's dp is the pool size divided by its own tp * cp * pp.
    """
    model_parallel = {}
    for role in training_config.roles:
        tp, cp, pp = role.tensor_model_parallel_size, role.context_parallel_size, 1
        if role.trainable:
            tp = layout.tensor_model_parallel_size or tp
            cp = layout.context_parallel_size or cp
            pp = layout.pipeline_model_parallel_size
        model_parallel[role.name] = (tp, cp, pp)
    resolved = {}
    for pool_name, members in training_config.role_graph().pools.items():
        pool_size = max(tp * cp * pp for tp, cp, pp in (model_parallel[name] for name in members)) * layout.data_parallel_size
        for name in members:
            tp, cp, pp = model_parallel[name]
            if pool_size % (tp * cp * pp):
                raise ValueError(
                    f"recipe {training_config.name!r}: role {name!r} (tp={tp}, cp={cp}, pp={pp}) cannot fill pool "
                    f"{pool_name!r} of {pool_size} ranks; colocated roles need tp * cp * pp dividing the pool size"
                )
            ep, etp = 1, tp
            if training_config.role(name).trainable:
                ep, etp = layout.expert_model_parallel_size, layout.expert_tensor_parallel_size or tp
            if (pool_size // pp) % (ep * etp):
                raise ValueError(
                    f"recipe {training_config.name!r}: role {name!r} has {pool_size // pp} ranks per pipeline stage, "
                    f"not divisible by --expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp}; "
                    "choose sizes whose product divides them (or raise --data-parallel-size)")
            resolved[name] = RoleLayout(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                        pipeline_model_parallel_size=pp,
                                        data_parallel_size=pool_size // (tp * cp * pp),
                                        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return resolved


@dataclass
class RoleWorkerGraph:
    """The running role graph: pools, one worker group per role, connected exchange syncs."""

    training_config: TrainingConfig
    """The recipe the workers are set up for now (the last run's, on a graph that served several)."""
    layouts: dict[str, RoleLayout]
    pools: dict[str, PlacedPool] = field(default_factory=dict)
    workers: dict[str, RoleWorkers] = field(default_factory=dict)
    exchanges: dict[str, ExchangeSyncGroup] = field(default_factory=dict)
    layout: WorkerLayout = field(default_factory=WorkerLayout)
    """The layout the workers were started with (`check_graph_fits` compares a run's with it)."""
    ended: str | None = None
    """Why the workers are gone ('shut down', 'killed after a failed run'); None while they run."""

    def shutdown(self) -> None:
        """Close exchanges, tear down every role's groups, kill the actors, free the pools."""
        self.ended = self.ended or "shut down"
        for exchange in self.exchanges.values():
            exchange.close()
        for workers in self.workers.values():
            workers.shutdown()
        for pool in self.pools.values():
            pool.remove()

    def kill(self, reason: str = "killed") -> None:
        """Kill every actor without teardown (after a failure) and free the pools."""
        self.ended = self.ended or reason
        for workers in self.workers.values():
            workers.kill()
        for pool in self.pools.values():
            pool.remove()

    def prepare_run(self, training_config: TrainingConfig, layout: WorkerLayout) -> None:
        """Make the running workers ready for a new run of `training_config` laid out by `layout`.

        Refuses (before any worker is touched) a run whose roles or layouts differ from the graph's, and a
        graph whose workers have ended (`check_graph_fits`). Then every worker is emptied
        (`RoleWorker.clear_for_next_run`: runtime, process groups, megatron-core's module state; the driver's
        user modules imported where missing), set up again with the run's collective timeout, and the run's
        exchange syncs are connected: what a fresh graph would have, in the same processes.
        """
        check_graph_fits(self, training_config, layout)
        try:
            for exchange in self.exchanges.values():
                exchange.close()
            self.exchanges = {}
            sources = user_module_sources()
            wait_all(*(workers.submit_all(RoleWorker.clear_for_next_run, sources)
                       for workers in self.workers.values()), what="emptying the role workers for the next run")
            self.training_config = training_config
            for workers in self.workers.values():
                workers.collective_timeout_s = layout.collective_timeout_s
                workers.call_timeout_s = layout.call_timeout_s
            set_up_roles(self, training_config, layout)
        except BaseException:
            self.kill("killed: preparing a run on them failed")
            raise

    def release_run(self) -> None:
        """Free what the finished run built on the workers (models, optimizers); the workers stay."""
        wait_all(*(workers.submit_all(_drop_state) for workers in self.workers.values()),
                 what="releasing the finished run's models")


def _drop_state(worker: RoleWorker) -> None:
    worker.state.clear()


def _describe_layout(layout: RoleLayout) -> str:
    return (f"tp={layout.tensor_model_parallel_size} cp={layout.context_parallel_size} "
            f"pp={layout.pipeline_model_parallel_size} dp={layout.data_parallel_size} "
            f"ep={layout.expert_model_parallel_size} etp={layout.expert_tensor_parallel_size} "
            f"({layout.world_size} ranks)")


def _colocation(training_config: TrainingConfig) -> set[frozenset[str]]:
    return {frozenset(members) for members in training_config.role_graph().pools.values()}


def check_graph_fits(graph: RoleWorkerGraph, training_config: TrainingConfig, layout: WorkerLayout) -> None:
    """Raise ValueError naming what differs when a run of `training_config` under `layout` cannot use
    `graph`'s workers: its roles, a role's layout (tp, cp, pp, dp, ep, etp), which roles share a pool, the
    GPUs per rank or the workers' environment variables (all fixed when the workers started); RuntimeError
    when the workers are gone (`RoleWorkerGraph.ended`)."""
    fix = ("start workers laid out for this run (create_role_workers with this run's recipe and layout), "
           "or leave graph= out and the run starts its own")
    if graph.ended is not None:
        raise RuntimeError(f"the role-worker graph's workers are gone ({graph.ended}); {fix}")
    wanted = resolve_role_layouts(training_config, layout)
    if set(wanted) != set(graph.layouts):
        raise ValueError(f"recipe {training_config.name!r} has roles {sorted(wanted)}, the role-worker graph runs "
                         f"roles {sorted(graph.layouts)}; {fix}")
    for name, role_layout in wanted.items():
        running = graph.layouts[name]
        if role_layout.parallel_sizes() != running.parallel_sizes() or role_layout.world_size != running.world_size:
            raise ValueError(f"role {name!r}: this run lays it out {_describe_layout(role_layout)}, the graph's "
                             f"workers are laid out {_describe_layout(running)}; {fix}")
    if _colocation(training_config) != _colocation(graph.training_config):
        raise ValueError(f"recipe {training_config.name!r} shares pools as "
                         f"{sorted(sorted(p) for p in _colocation(training_config))}, the graph's workers as "
                         f"{sorted(sorted(p) for p in _colocation(graph.training_config))}; {fix}")
    for name in ("num_gpus_per_rank", "worker_env_vars"):
        if getattr(layout, name) != getattr(graph.layout, name):
            raise ValueError(f"worker layout field {name!r}: this run asks {getattr(layout, name)!r}, the graph's "
                             f"workers started with {getattr(graph.layout, name)!r}; {fix}")


def create_role_workers(training_config: TrainingConfig, layout: Any = None, *, pool_timeout_s: float = 120.0) -> RoleWorkerGraph:
    """Start and set up one `RoleWorkers` per role of `training_config`, then connect its exchange syncs.

    `layout` is a `WorkerLayout`, the run config's `parallel` section (converted with
    `WorkerLayout.from_parallel_section`), or None for the defaults. Ray must be connected
    (`stacx.trainer.cluster.ray.connect.connect_ray`). On any failure every actor and placement group
    created so far is released before the error propagates.
    """
    if layout is None:
        layout = WorkerLayout()
    elif not isinstance(layout, WorkerLayout):
        layout = WorkerLayout.from_parallel_section(layout)
    role_graph = training_config.role_graph()
    graph = RoleWorkerGraph(training_config, resolve_role_layouts(training_config, layout), layout=layout)
    try:
        for pool_name, members in role_graph.pools.items():
            pool = ResourcePool(
                name=pool_name,
                num_bundles=max(graph.layouts[name].world_size for name in members),
                num_cpus_per_bundle=layout.num_cpus_per_rank,
                num_gpus_per_bundle=layout.num_gpus_per_rank,
                bundle_resources=tuple(layout.pool_bundle_resources.get(pool_name, ())),
                strategy=layout.placement_strategy,
            )
            graph.pools[pool_name] = PlacedPool.create(pool, num_sharing_roles=len(members), timeout_s=pool_timeout_s)
        for role in training_config.roles:
            role_layout = graph.layouts[role.name]
            graph.workers[role.name] = RoleWorkers(
                role.name,
                role_layout.world_size,
                RolePlacement(graph.pools[training_config.pool_of(role.name)]),
                **role_layout.parallel_sizes(),
                collective_timeout_s=layout.collective_timeout_s,
                call_timeout_s=layout.call_timeout_s,
                env_vars=dict(layout.worker_env_vars) or None,
            )
        set_up_roles(graph, training_config, layout)
    except BaseException:
        graph.kill()
        raise
    return graph


def set_up_roles(graph: RoleWorkerGraph, training_config: TrainingConfig, layout: WorkerLayout) -> None:
    """Every role's process groups (`RoleWorker.setup`), then `training_config`'s exchange syncs connected."""
    wait_all(*(workers.submit_setup() for workers in graph.workers.values()), what="role worker setup")
    for sync in training_config.role_graph().exchange_syncs:
        colocated = training_config.pool_of(sync.source_role) == training_config.pool_of(sync.target_role)
        # NCCL refuses two ranks on one GPU; colocated GPU roles exchange over gloo.
        backend = "gloo" if colocated and layout.num_gpus_per_rank > 0 else "auto"
        exchange = ExchangeSyncGroup(
            sync.name,
            graph.workers[sync.source_role],
            graph.workers[sync.target_role],
            backend=backend,
            timeout_s=layout.collective_timeout_s,
            bucket_bytes=sync.bucket_size_mb * MIB,
        )
        exchange.connect()
        graph.exchanges[exchange.name] = exchange
