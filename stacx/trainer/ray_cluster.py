"""Start or attach to the Ray cluster a run uses.

Where the cluster comes from, first match wins:

1. `--ray-address ADDRESS` (run config `ray_address`): attach to that existing cluster.
2. `RAY_ADDRESS` in the environment: attach. `ray job submit` sets it for the job's entry
   command, so a Stacx entry script submitted as a job lands on the job's cluster unchanged.
3. Neither: start a private local cluster sized by `num_cpus` / `num_gpus`.

    connection = connect_ray(cli_address=args.ray_address, num_cpus=4)
    ...
    connection.shutdown()   # stops a local cluster; only disconnects from an attached one
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

RAY_ADDRESS_ENV = "RAY_ADDRESS"


def resolve_ray_address(cli_address: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The address to attach to, or None to start a local cluster (see the module docstring)."""
    environ = os.environ if environ is None else environ
    for candidate in (cli_address, environ.get(RAY_ADDRESS_ENV)):
        if candidate is not None and candidate.strip():
            return candidate.strip()
    return None


@dataclass(frozen=True)
class RayConnection:
    """How this process is connected to Ray."""

    address: str | None
    """The attached cluster's address, or None for a cluster this process started."""
    started_locally: bool
    """True when this process started the cluster (and `shutdown` stops it)."""
    already_connected: bool = False
    """True when Ray was initialized before `connect_ray` was called (then `shutdown` leaves it)."""

    def shutdown(self) -> None:
        """Disconnect this process (which also stops a cluster it started)."""
        import ray

        if not self.already_connected and ray.is_initialized():
            ray.shutdown()


def connect_ray(
    cli_address: str | None = None,
    *,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    object_store_memory_bytes: int | None = None,
    namespace: str = "stacx",
    log_to_driver: bool = True,
    environ: Mapping[str, str] | None = None,
) -> RayConnection:
    """Attach to an existing cluster or start a local one; returns how we are connected.

    Sizing arguments apply to a local cluster only; passing them while attaching is an error
    (an attached cluster's resources are set by its own `ray start`).
    """
    import ray

    address = resolve_ray_address(cli_address, environ)
    sized = {name: value for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus),
                                             ("object_store_memory_bytes", object_store_memory_bytes))
             if value is not None}
    if address is not None and sized:
        raise ValueError(
            f"attaching to the Ray cluster at {address!r} (from --ray-address or {RAY_ADDRESS_ENV}); "
            f"{sorted(sized)} only size a local cluster - set them on that cluster's `ray start` instead"
        )
    if ray.is_initialized():
        return RayConnection(address=None, started_locally=False, already_connected=True)
    if address is not None:
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)
        except ConnectionError as err:
            raise ConnectionError(
                f"cannot attach to the Ray cluster at {address!r} (from --ray-address or {RAY_ADDRESS_ENV}): {err}"
            ) from err
        return RayConnection(address=address, started_locally=False)
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        object_store_memory=object_store_memory_bytes,
        include_dashboard=False,
        namespace=namespace,
        log_to_driver=log_to_driver,
    )
    return RayConnection(address=None, started_locally=True)
