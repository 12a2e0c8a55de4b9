"""Start or attach to the Ray cluster a run uses.

Where the cluster comes from, first match wins:

1. `--ray-address ADDRESS` (run config `ray_address`): attach to that existing cluster.
2. `RAY_ADDRESS` in the environment: attach. `ray job submit` sets it for the job's entry
   command, so a Stacx entry script submitted as a job lands on the job's cluster unchanged.
3. Neither: start a private local cluster sized by `num_cpus` / `num_gpus`. Its node address
   is 127.0.0.1, so its GCS, raylet, object manager and agents listen on loopback only and
   nothing on the network can reach them (`start_local_cluster`; docs/security.md). A reaper
   process ends the cluster's processes when this driver ends, even SIGKILLed (`reaper`).

    connection = connect_ray(cli_address=args.ray_address, num_cpus=4)
    ...
    connection.shutdown()   # stops a local cluster; only disconnects from an attached one
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

from stacx.network import is_loopback_host
from stacx.trainer.cluster.ray.reaper import ClusterReaper
from stacx.trainer.cluster.ray.tensor_transport import register_tensor_transport

RAY_ADDRESS_ENV = "RAY_ADDRESS"
LOOPBACK_ADDRESS = "127.0.0.1"
"""The node address of every local cluster `connect_ray` starts."""
RAY_LOGGING_LEVEL = logging.WARNING
"""Level of Ray's own loggers in the driver and the workers (`ray.init(logging_level=...)`): Ray's INFO
lines (the local instance started, the dashboard, the connection) stay out of a run's output; its
warnings and errors, and everything the run's workers print or raise, still show."""
WORKER_NICENESS_INCREMENT = 0
"""Ray's `worker_niceness` for a local cluster `connect_ray` starts: how much lower than the cluster's own
processes its workers run (Ray adds it with nice(2)). Ray's default, 15, keeps a driver responsive beside
busy workers; in a Stacx run the role workers are the run's work and the driver mostly waits on them, so
at 15 a run on a busy machine trains at the leftovers of every other process (a demo's role worker got
11 s of CPU in its first 4 minutes at load 15 on 2 cores, importing torch). 0: the run's own priority;
`nice stacx ...` still lowers the whole run. An attached cluster keeps its own `ray start` setting."""
RAY_AUTH_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
"""Ray's logger that warns, on every new local cluster, that it turned token authentication on."""


@contextlib.contextmanager
def _quiet_token_auth_notice() -> Iterator[None]:
    """Ray enables token authentication for a new local cluster (good: nobody else on the network can
    run code on it) and logs a warning that it did, in every run; only that notice is hidden, errors
    still show. A user's RAY_AUTH_MODE is honoured by Ray as before."""
    notice_logger = logging.getLogger(RAY_AUTH_SETUP_LOGGER)
    previous = notice_logger.level
    notice_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notice_logger.setLevel(previous)


LEAN_DAEMON_ENV = {
    "RAY_enable_metrics_collection": "0",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "METRICS_RECORD_INTERVAL_S": "60",
    "RAY_USAGE_STATS_ENABLED": "0",
}
"""The environment a local cluster's daemons start with (a value the user set wins). A cluster `connect_ray`
starts has no dashboard, so nothing reads Ray's metrics: without them no process exports OpenTelemetry
histograms to the dashboard agent every few seconds and the agent ingests none; the agent's and the
dashboard head's psutil sweeps of every Ray process run every minute instead of every 5 s; and no usage
statistics are collected. These daemons poll, so they cost CPU in proportion to a run's wall time: in the
CPU demo Ray's own processes took 31 s of CPU instead of 52 (docs/testing.md, session 10)."""
QUIET_LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}
"""Also, for a driver that takes no worker logs (`log_to_driver=False`): Ray's log monitor looks for new log
files every 5 s instead of every 0.1 s (it forwards worker output only to drivers that take it)."""


@contextlib.contextmanager
def _lean_daemon_environment(log_to_driver: bool) -> Iterator[None]:
    """While active (the `ray.init` that starts a local cluster, whose daemons and workers inherit it), the
    environment of LEAN_DAEMON_ENV (and QUIET_LOG_MONITOR_ENV without worker logs); variables the user
    set keep their values. Restored after, so the run's other child processes do not get it."""
    wanted = {**LEAN_DAEMON_ENV, **({} if log_to_driver else QUIET_LOG_MONITOR_ENV)}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _announce(message: str) -> None:
    """A line on stderr before a wait that can pass 10 s, so that a quiet start never looks hung."""
    import sys

    print(f"stacx: {message}", file=sys.stderr, flush=True)


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
    reaper: ClusterReaper | None = None
    """The watcher that ends a local cluster's processes with this driver (None when attached)."""

    def shutdown(self) -> None:
        """Disconnect this process (which also stops a cluster it started, and what of it lingers)."""
        # Imported here: Ray is slow to import (start-up time).
        import ray

        try:
            if not self.already_connected and ray.is_initialized():
                ray.shutdown()
        finally:
            if self.reaper is not None:
                self.reaper.finish()


@contextlib.contextmanager
def _ray_keeps_loopback_node_addresses() -> Iterator[None]:
    """While active, Ray takes 127.0.0.1 as the address of a node it starts, as asked.

    Why: `ray.init(_node_ip_address="127.0.0.1")` is rewritten to the host's interface address
    (Ray assumes a node must be reachable from other nodes), and every Ray process then listens
    on all interfaces. Ray keeps a loopback address only where it does not support multi-node
    clusters, a switch read from `ray._private.ray_constants.ENABLE_RAY_CLUSTER` (set from
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import). It is consulted only while resolving the new
    node's address, so it is switched off for the `ray.init` call and restored after it;
    `start_local_cluster` checks the result, so a Ray release that changes this fails loudly.
    """
    # Imported here: Ray is slow to import (start-up time).
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def is_loopback_address(address: str) -> bool:
    """True for a `host:port` cluster address whose host only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return is_loopback_host(host)


def node_addresses() -> list[str]:
    """The address of every node of the connected cluster, as Ray reports it."""
    # Imported here: Ray is slow to import (start-up time).
    import ray

    return [node["NodeManagerAddress"] for node in ray.nodes()]


#: Ray gives a new node 30 s (fixed in its code) to register before it gives up; on a machine whose cores are
#: all busy that can pass. A local start is tried this many times before the run fails.
LOCAL_START_ATTEMPTS = 2
_RAY_NODE_START_TIMEOUT = "timed out during startup"


def start_local_cluster(**init_kwargs) -> None:
    """`ray.init(**init_kwargs)` for a new single-node cluster whose node address is 127.0.0.1, its workers at
    this process's priority (WORKER_NICENESS_INCREMENT), its daemons polling less (LEAN_DAEMON_ENV).

    A start that Ray abandons because the node did not register in time is retried (LOCAL_START_ATTEMPTS
    in all), then fails with a RuntimeError that says what to do. RuntimeError (after shutting it down) if
    Ray reports any other node address.
    """
    # Imported here: Ray is slow to import (start-up time).
    import ray

    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with _ray_keeps_loopback_node_addresses(), _quiet_token_auth_notice(), \
                    _lean_daemon_environment(init_kwargs.get("log_to_driver", True)):
                # A new dict per attempt: Ray writes its defaults into the one it is given, and warns about
                # them ("object spilling config ... unstable API") when a retry passes them back.
                ray.init(_node_ip_address=LOOPBACK_ADDRESS,
                         _system_config={"worker_niceness": WORKER_NICENESS_INCREMENT}, **init_kwargs)
            break
        except Exception as err:  # Ray raises a bare Exception for this one
            if _RAY_NODE_START_TIMEOUT not in str(err):
                raise
            ray.shutdown()  # stops what the abandoned start left running
            if attempt == LOCAL_START_ATTEMPTS:
                load = f"load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores; " if hasattr(os, "getloadavg") else ""
                raise RuntimeError(
                    f"the local Ray cluster did not start: Ray's node did not register within Ray's 30 s, "
                    f"{LOCAL_START_ATTEMPTS} times ({load}Ray: {err}). The machine is probably too busy: retry when "
                    "it is quieter, or start a cluster yourself (`ray start --head --node-ip-address 127.0.0.1`) and "
                    "pass --ray-address 127.0.0.1:6379, or launch with torchrun, which needs no Ray"
                ) from err
            logging.getLogger(__name__).warning("the local Ray cluster did not start in time (%s); trying again", err)
    addresses = node_addresses()
    if any(address != LOOPBACK_ADDRESS for address in addresses):
        ray.shutdown()
        raise RuntimeError(
            f"the local Ray cluster took node addresses {addresses} instead of {LOOPBACK_ADDRESS}, so it would listen "
            f"on the network; this Ray release ({ray.__version__}) no longer honours the loopback switch in "
            "stacx.trainer.cluster.ray.connect - update _ray_keeps_loopback_node_addresses, or start the cluster yourself "
            "and pass --ray-address"
        )


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
    # Imported here: Ray is slow to import (start-up time).
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
        register_tensor_transport()
        return RayConnection(address=None, started_locally=False, already_connected=True)
    # This driver's side of the connection: the same whether it attaches or starts the cluster.
    driver = {"namespace": namespace, "log_to_driver": log_to_driver, "logging_level": RAY_LOGGING_LEVEL}
    if address is not None:
        # A loopback cluster (one `connect_ray` started, e.g. in another process) is reached on
        # loopback too: Ray would rewrite 127.0.0.1 to the host's interface address, where it does not listen.
        attach_loopback = _ray_keeps_loopback_node_addresses() if is_loopback_address(address) else contextlib.nullcontext()
        try:
            with attach_loopback:
                ray.init(address=address, **driver)
        except ConnectionError as err:
            raise ConnectionError(
                f"cannot attach to the Ray cluster at {address!r} (from --ray-address or {RAY_ADDRESS_ENV}): {err}"
            ) from err
        register_tensor_transport()
        return RayConnection(address=address, started_locally=False)
    _announce(f"starting a local Ray cluster ({'all' if num_cpus is None else f'{num_cpus:g}'} CPUs; "
              "tens of seconds on a busy machine)...")
    reaper = ClusterReaper.start()  # the cluster's processes end with this driver, even a SIGKILLed one
    try:
        start_local_cluster(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory_bytes,
                            include_dashboard=False, **driver)
    except BaseException:
        reaper.finish()
        raise
    register_tensor_transport()
    return RayConnection(address=None, started_locally=True, reaper=reaper)
