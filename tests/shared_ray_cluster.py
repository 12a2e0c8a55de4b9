"""One loopback Ray cluster that many test drivers attach to, held by a small child process.

Starting a local Ray cluster costs about 5 s of two busy cores (GCS, raylet, agents), and stopping
it another 1-2 s; a test suite whose end-to-end runs each start their own pays that dozens of
times. A holder process starts one cluster with `connect_ray` (node address 127.0.0.1, so nothing
off the machine can reach it) and keeps it until told to stop; test processes attach to it with
`connect_ray(address)` or `stacx train --ray-address ADDRESS`, and detach when done (which ends
their Ray job and kills its actors, so the next test starts from an empty cluster).

Ray turns token authentication on for a new local cluster (its token file is in the user's home,
the switch is the `RAY_AUTH_MODE` variable of the process that started it); a driver attaching
from another process needs the same switch, which the holder reports as `attach_env`.

    cluster = SharedRayCluster.start(num_cpus=4, object_store_mb=300)
    env = {**os.environ, **cluster.attach_env}
    ... subprocess.run(["stacx", "train", "--ray-address", cluster.address, ...], env=env)
    cluster.close()

The holder is its own process (not the test process) so that a test may still start, check and
stop a private cluster of its own in-process while the shared one runs. As a command:

    python -m tests.shared_ray_cluster --num-cpus 4 --object-store-mb 300

prints `attach_env=<JSON>` and `address=<GCS address>` once the cluster is up and stops it when its standard input closes
or it receives SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from tests.warm import warm_python

ADDRESS_LINE_PREFIX = "address="
HOLDER_PID_LINE_PREFIX = "holder_pid="
ATTACH_ENV_LINE_PREFIX = "attach_env="
RAY_AUTH_ENV_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
"""Ray's token-authentication settings, which an attaching driver must share with the cluster's starter."""
MIB = 1024 * 1024
NO_IDLE_WORKERS_ENV = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0"}
"""Set in the holder before it starts the cluster (its raylet inherits them). Ray prestarts Python workers
for the first driver that connects: here the holder, whose job never runs anything, so they sat as
`ray::IDLE` processes for the whole pytest run (a worker is tied to its job, so no test's actor could
use them), each ticking about 0.6-0.75 s of CPU a minute, and each cost a worker's start. Without them
an idle cluster spends about half the CPU (2.6 -> 1.3 s a minute, docs/testing.md session 12); a test's
job starts the workers its actors need, as it did before."""


@dataclass
class SharedRayCluster:
    """A running holder process and the address of the cluster it holds."""

    address: str
    process: subprocess.Popen
    attach_env: dict[str, str]
    """Environment variables a driver attaching to this cluster needs (Ray's auth settings)."""
    holder_pid: int
    """The process that started the cluster (its daemons are its descendants). Not `process.pid` when the
    holder runs warm (tests/warm.py): that is the client the zygote's child reports to."""

    @classmethod
    def start(cls, *, num_cpus: int = 4, object_store_mb: int = 300, timeout_s: float = 180.0,
              env: dict | None = None, cwd: str | None = None) -> "SharedRayCluster":
        """Start the holder and wait (at most `timeout_s`) until it reports the cluster's address.

        RuntimeError with the holder's output if it exits or stays silent past the deadline.
        """
        process = subprocess.Popen(
            [warm_python(), "-m", "tests.shared_ray_cluster", "--num-cpus", str(num_cpus),
             "--object-store-mb", str(object_store_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, cwd=cwd, start_new_session=True)
        lines: list[str] = []
        found: list[str] = []
        holder_pid: list[int] = []
        attach_env: dict[str, str] = {}

        def read_until_address() -> None:
            for line in process.stdout:
                lines.append(line)
                if line.startswith(HOLDER_PID_LINE_PREFIX):
                    holder_pid.append(int(line[len(HOLDER_PID_LINE_PREFIX):]))
                if line.startswith(ATTACH_ENV_LINE_PREFIX):
                    attach_env.update(json.loads(line[len(ATTACH_ENV_LINE_PREFIX):]))
                if line.startswith(ADDRESS_LINE_PREFIX):
                    found.append(line[len(ADDRESS_LINE_PREFIX):].strip())
                    return

        reader = threading.Thread(target=read_until_address, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            _stop(process)
            state = f"exited with {process.returncode}" if process.poll() is not None else f"silent after {timeout_s:.0f} s"
            raise RuntimeError(f"the shared Ray cluster holder {state}; its output:\n{''.join(lines)[-4000:]}")
        # Keep draining its output so that Ray's own log lines can never fill the pipe and block it.
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
        return cls(address=found[0], process=process, attach_env=attach_env, holder_pid=holder_pid[0])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the cluster: close the holder's stdin (it shuts Ray down), kill its session after `timeout_s`."""
        _stop(self.process, timeout_s)


def _stop(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    try:
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        process.wait(timeout=timeout_s)
    except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
        pass
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=timeout_s)


def _hold(num_cpus: int, object_store_mb: int) -> int:
    from stacx.trainer.cluster.ray.connect import connect_ray

    import ray

    for name, value in NO_IDLE_WORKERS_ENV.items():
        os.environ.setdefault(name, value)
    connection = connect_ray(num_cpus=num_cpus, object_store_memory_bytes=object_store_mb * MIB, log_to_driver=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(ATTACH_ENV_LINE_PREFIX + json.dumps({name: os.environ[name] for name in RAY_AUTH_ENV_VARS if name in os.environ}),
          flush=True)
    print(HOLDER_PID_LINE_PREFIX + str(os.getpid()), flush=True)
    print(ADDRESS_LINE_PREFIX + ray.get_runtime_context().gcs_address, flush=True)
    while not stop.is_set():
        stop.wait(1.0)
    connection.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.shared_ray_cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs the cluster offers (default 4)")
    parser.add_argument("--object-store-mb", type=int, default=300, help="object store size in MiB (default 300)")
    args = parser.parse_args(argv)
    return _hold(args.num_cpus, args.object_store_mb)


if __name__ == "__main__":
    sys.exit(main())
