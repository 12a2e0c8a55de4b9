"""`RoleWorkers`: the Ray actors of one role, driven as one unit from the driver.

    workers = RoleWorkers("policy", 2, placement, tensor_model_parallel_size=2)
    workers.setup()                                   # torch.distributed + megatron groups
    values = workers.execute_all(all_reduce_rank)     # one result per rank, rank order
    workers.kill()

Every call waits through `health.wait_for_worker_results`: a rank that raises or dies fails
the call at once with the role and rank in the message; `call_timeout_s` bounds each call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from stacx.plugins.discovery import user_module_sources
from stacx.trainer.cluster.ray.health import WorkerLabel, wait_for_worker_results
from stacx.trainer.cluster.ray.placement import RolePlacement
from stacx.trainer.cluster.ray.role_worker import RoleWorker


class PendingCall:
    """A call submitted to some workers; `result()` waits for it like a blocking call would."""

    def __init__(self, refs: list, labels: list[WorkerLabel], timeout_s: float | None, what: str):
        self.refs = refs
        self.labels = labels
        self.timeout_s = timeout_s
        self.what = what

    def result(self) -> list[Any]:
        return wait_for_worker_results(self.refs, self.labels, timeout_s=self.timeout_s, what=self.what)


def wait_all(*calls: PendingCall, what: str = "call") -> list[list[Any]]:
    """Wait for several pending calls together, failing on the first failing rank of any of them."""
    refs = [ref for call in calls for ref in call.refs]
    labels = [label for call in calls for label in call.labels]
    timeouts = [call.timeout_s for call in calls if call.timeout_s is not None]
    flat = wait_for_worker_results(refs, labels, timeout_s=max(timeouts) if timeouts else None, what=what)
    out, start = [], 0
    for call in calls:
        out.append(flat[start : start + len(call.refs)])
        start += len(call.refs)
    return out


def _describe(fn: Callable[..., Any]) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))


class RoleWorkers:
    """`num_ranks` actors of `role_name`, rank i in bundle i of the placement's pool."""

    def __init__(
        self,
        role_name: str,
        num_ranks: int,
        placement: RolePlacement,
        *,
        tensor_model_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        collective_timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        worker_cls: type = RoleWorker,
        num_threads: int | None = 1,
        env_vars: dict[str, str] | None = None,
        user_modules: Sequence | None = None,
    ):
        """Start the actors (they import nothing heavy until `setup`, unless user modules are shipped).

        `collective_timeout_s` bounds every collective inside the role; `call_timeout_s`, when
        set, bounds every driver call (None: only deaths and errors end a call early).
        `expert_model_parallel_size` / `expert_tensor_parallel_size` lay a mixture-of-experts model's
        expert grid over the same ranks (ep x etp must divide num_ranks / pp; etp None: tp).
        `num_threads` sets torch's intra-op threads per worker (None leaves Ray's default).
        `user_modules`: sources of the user modules every actor imports when it starts
        (`stacx.plugins.discovery.UserModuleSource`); None ships every user module this
        process has imported (`--custom-module` files and `stacx/custom/`).
        """
        # Imported here: Ray is slow to import (start-up time).
        import ray


        if user_modules is None:
            user_modules = user_module_sources()

        model_parallel = tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size
        if num_ranks < 1 or num_ranks % model_parallel != 0:
            raise ValueError(
                f"role {role_name!r}: num_ranks ({num_ranks}) must be a positive multiple of "
                f"tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size = "
                f"{tensor_model_parallel_size} * {context_parallel_size} * {pipeline_model_parallel_size}"
            )
        etp = expert_tensor_parallel_size or tensor_model_parallel_size
        if expert_model_parallel_size < 1 or (num_ranks // pipeline_model_parallel_size) % (expert_model_parallel_size * etp):
            raise ValueError(
                f"role {role_name!r}: --expert-model-parallel-size {expert_model_parallel_size} x "
                f"--expert-tensor-parallel-size {etp} must divide the role's {num_ranks // pipeline_model_parallel_size} "
                "ranks per pipeline stage; choose sizes whose product divides them")
        self.role_name = role_name
        self.num_ranks = num_ranks
        self.placement = placement
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.context_parallel_size = context_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.expert_model_parallel_size = expert_model_parallel_size
        self.expert_tensor_parallel_size = etp
        self.collective_timeout_s = collective_timeout_s
        self.call_timeout_s = call_timeout_s
        self.labels = [WorkerLabel(role_name, rank) for rank in range(num_ranks)]
        remote_cls = ray.remote(worker_cls)
        runtime_env = {"env_vars": dict(env_vars)} if env_vars else None
        self.actors = []
        for rank in range(num_ranks):
            options = {**placement.actor_options(rank), "max_restarts": 0, "max_task_retries": 0}
            if runtime_env:
                options["runtime_env"] = runtime_env
            self.actors.append(remote_cls.options(**options).remote(role_name, rank, num_ranks,
                                                                   num_threads=num_threads,
                                                                   user_modules=tuple(user_modules)))

    @property
    def data_parallel_size(self) -> int:
        return self.num_ranks // (self.tensor_model_parallel_size * self.context_parallel_size
                                  * self.pipeline_model_parallel_size)

    # ---- calls --------------------------------------------------------------------------
    def submit_all(self, fn: Callable[..., Any], *args, timeout_s: float | None = None, **kwargs) -> PendingCall:
        """Start `fn` on every rank without waiting (see `RoleWorker.execute`)."""
        refs = [actor.execute.remote(fn, *args, **kwargs) for actor in self.actors]
        return PendingCall(refs, self.labels, self._timeout(timeout_s), f"{_describe(fn)} on role {self.role_name!r}")

    def submit_per_rank(self, fn: Callable[..., Any], args_per_rank: Sequence[tuple], *,
                        timeout_s: float | None = None) -> PendingCall:
        """Start `fn(worker, *args_per_rank[rank])` on every rank (e.g. each DP rank's micro-batches)."""
        if len(args_per_rank) != self.num_ranks:
            raise ValueError(
                f"role {self.role_name!r}: got arguments for {len(args_per_rank)} ranks, the role has {self.num_ranks}"
            )
        refs = [actor.execute.remote(fn, *args) for actor, args in zip(self.actors, args_per_rank)]
        return PendingCall(refs, self.labels, self._timeout(timeout_s), f"{_describe(fn)} on role {self.role_name!r}")

    def execute_all(self, fn: Callable[..., Any], *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """Run `fn` on every rank; per-rank results in rank order."""
        return self.submit_all(fn, *args, timeout_s=timeout_s, **kwargs).result()

    def execute_per_rank(self, fn: Callable[..., Any], args_per_rank: Sequence[tuple], *,
                         timeout_s: float | None = None) -> list[Any]:
        return self.submit_per_rank(fn, args_per_rank, timeout_s=timeout_s).result()

    def execute_rank0(self, fn: Callable[..., Any], *args, timeout_s: float | None = None, **kwargs) -> Any:
        """Run `fn` on rank 0 only (must not enter a collective of the role)."""
        ref = self.actors[0].execute.remote(fn, *args, **kwargs)
        what = f"{_describe(fn)} on role {self.role_name!r} rank 0"
        return wait_for_worker_results([ref], self.labels[:1], timeout_s=self._timeout(timeout_s), what=what)[0]

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.call_timeout_s if timeout_s is None else timeout_s

    # ---- lifecycle ----------------------------------------------------------------------
    def submit_setup(self, timeout_s: float | None = None) -> PendingCall:
        """Start torch.distributed + megatron group initialization on every rank."""
        # Rank 0 hosts the store on its node's cluster address; the other ranks connect to it.
        master_addr, master_port = self.execute_rank0(RoleWorker.host_rendezvous, self.collective_timeout_s,
                                                      timeout_s=timeout_s or 300.0)
        refs = [
            actor.setup.remote(rank, self.num_ranks, master_addr, master_port, self.tensor_model_parallel_size,
                               self.context_parallel_size, self.collective_timeout_s,
                               self.pipeline_model_parallel_size, self.expert_model_parallel_size,
                               self.expert_tensor_parallel_size)
            for rank, actor in enumerate(self.actors)
        ]
        # Startup includes process launch and imports; allow for it beyond the collective timeout.
        deadline = timeout_s or (self.collective_timeout_s + 120.0)
        return PendingCall(refs, self.labels, deadline, f"setup of role {self.role_name!r}")

    def setup(self, timeout_s: float | None = None) -> list[dict]:
        """Initialize the role's process groups; returns each rank's (tp, cp, dp) coordinates."""
        return self.submit_setup(timeout_s).result()

    def placement_info(self) -> list[dict]:
        return self.execute_all(RoleWorker.placement_info)

    def kill(self) -> None:
        """Kill every actor of the role now (no graceful teardown; safe to call twice)."""
        # Imported here: Ray is slow to import (start-up time).
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or the cluster is gone
                pass

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tear down process groups, then kill the actors (even if teardown fails)."""
        try:
            self.execute_all(RoleWorker.shutdown, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - teardown after a failure; the actors die below anyway
            pass
        finally:
            self.kill()

    def __repr__(self) -> str:
        return (f"RoleWorkers({self.role_name!r}, num_ranks={self.num_ranks}, tp={self.tensor_model_parallel_size}, "
                f"cp={self.context_parallel_size}, ep={self.expert_model_parallel_size}, pool={self.placement.pool.pool.name!r})")
