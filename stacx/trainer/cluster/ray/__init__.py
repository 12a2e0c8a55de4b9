"""Ray execution of roles: one `RoleWorkers` group of `RoleWorker` actors per role.

- `connect`: connecting to (or starting) the Ray cluster.
- `graph`: from a recipe to running workers (`create_role_workers`, `WorkerLayout`).
- `group`: `RayRoleGroup`, the `RoleGroup` of one role's workers (and the functions it ships).
- `placement`: resource pools (one placement group each; colocated roles share bundles).
- `role_worker`: the actor - one torch.distributed rank running driver-shipped code.
- `role_workers`: the driver's handle on one role's actors (`execute_all`, `execute_rank0`, `kill`).
- `exchange` / `exchange_endpoint`: exchange-sync groups moving tensors bitwise between two roles'
  workers (driver side / worker side).
- `health`: failure detection; errors name the role and rank.

Importing this package does not import Ray; the submodules import it where they use it.
"""

from stacx.trainer.cluster.ray.exchange import ExchangeSyncGroup
from stacx.trainer.cluster.ray.health import (
    RoleWorkerDied,
    RoleWorkerError,
    RoleWorkerRaised,
    RoleWorkerTimeout,
    WorkerLabel,
)
from stacx.trainer.cluster.ray.placement import PlacedPool, ResourcePool, RolePlacement
from stacx.trainer.cluster.ray.role_worker import RoleWorker
from stacx.trainer.cluster.ray.role_workers import PendingCall, RoleWorkers, wait_all

__all__ = [
    "ExchangeSyncGroup",
    "PendingCall",
    "PlacedPool",
    "ResourcePool",
    "RolePlacement",
    "RoleWorker",
    "RoleWorkerDied",
    "RoleWorkerError",
    "RoleWorkerRaised",
    "RoleWorkerTimeout",
    "RoleWorkers",
    "WorkerLabel",
    "wait_all",
]
