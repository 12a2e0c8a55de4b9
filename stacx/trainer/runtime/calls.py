"""Functions the driver ships to Ray role workers: `fn(worker, ...)` (see RoleWorker.execute).

    workers.execute_all(build_runtime, role, run_config, algorithm)
    workers.execute_per_rank(call_runtime, [("train_step", shard, counts), ...])
"""

from __future__ import annotations

from typing import Any

RUNTIME_KEY = "runtime"


def build_runtime(worker, role, run_config, algorithm) -> dict:
    """Build this rank's RoleRuntime into `worker.state`; returns its (tp, cp, dp) coordinates."""
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    worker.state[RUNTIME_KEY] = RoleRuntime(role, run_config, algorithm, worker.groups, rank=worker.rank)
    groups = worker.groups
    return {"tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank, "dp_rank": groups.dp_rank}


def call_runtime(worker, method: str, *args, **kwargs) -> Any:
    """`worker.state["runtime"].<method>(*args, **kwargs)`."""
    runtime = worker.state.get(RUNTIME_KEY)
    if runtime is None:
        raise RuntimeError(f"role {worker.role_name!r} rank {worker.rank}: no runtime built (build_runtime first)")
    return getattr(runtime, method)(*args, **kwargs)
