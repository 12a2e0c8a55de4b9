"""A two-node Ray cluster on this machine: one role's ranks on both nodes (the cluster check, attached
with `--ray-address`), and a two-step GRPO `stacx train` run submitted with `ray job submit` whose
workers land on both nodes. (`stacx train --ray-address` against a running single-node cluster runs
in most end-to-end tests, which attach to the shared test cluster.)

Two `ray start --block` processes (each in its own session) form the cluster: the head with
custom resource `node_a`, a second node with `node_b`. The cluster check entry point
(`python -m stacx.trainer.cluster.ray.cluster_check`) pins rank 0 to node_a and rank 1 to node_b,
runs TP=2 and world all-reduces across them plus an exchange transfer, and verifies the results
against exact float64 sums; the tests re-check them here. Unlike Stacx's private local clusters
(127.0.0.1), a multi-node `ray start` cluster takes the host's address: Ray rewrites a loopback
`--node-ip-address` to it, and a second node cannot join a head bound to loopback. The private
auth token keeps other local users out. The cluster uses a private auth token
and temp dir, and teardown signals only the two sessions it started (never a machine-wide
`ray stop`, which would end other users' clusters).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from stacx.tasks import write_tiny_checkpoint
from stacx.testing.ray_jobs import JobAgentNotReadyError, wait_until_jobs_are_accepted
from stacx.trainer.cluster.ray.cluster_check import RESULT_PREFIX, rank_contribution
from stacx.trainer.cluster.ray.connect import LEAN_DAEMON_ENV
from tests.shared_ray_cluster import NO_IDLE_WORKERS_ENV
from tests.warm import warm_python

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
OBJECT_STORE_BYTES = 200_000_000
NODE_START_ATTEMPTS = 4
RAY_NODE_START_TIMED_OUT = "The current node timed out during startup"
"""What `ray start` prints when its node missed Ray's fixed 30 s registration limit (ray/_private/node.py)."""


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports (all sockets are held open until every port is picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _private_agent_ports() -> list[str]:
    """Ports of a node's per-node agents. Ray's defaults are fixed (dashboard agent 52365, ...), so
    a second cluster on the same machine (another test's, another user's, or the other node of
    this one) would find them taken; the head's job agent then never serves and every
    `ray job submit` fails with "No available agent". Each node gets its own free ports."""
    listen, grpc, runtime_env, metrics = _free_ports(4)
    return [f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
            f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}"]


def _wait_for_line(log_path: str, text: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path) as f:
            if text in f.read():
                return
        if process.poll() is not None:
            break
        time.sleep(0.5)
    with open(log_path) as f:
        raise RuntimeError(f"`ray start` did not report {text!r} (exit {process.poll()}):\n{f.read()[-3000:]}")


def _stop_sessions(processes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM the sessions `ray start --block` leads (it and the Ray processes it started), all at
    once; SIGKILL every session still there `grace_s` after the signal (one deadline for all)."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the session's Ray processes, even when its leader exited
        except ProcessLookupError:
            pass
        process.wait()


def _agent_log_tails(temp_dir: str) -> str:
    """The end of each node's dashboard-agent log, to say why a job agent never came up."""
    tails = []
    for root, _, files in os.walk(temp_dir):
        for name in files:
            if name.startswith("dashboard_agent") and name.endswith(".log"):
                with open(os.path.join(root, name), errors="replace") as f:
                    tails.append(f"--- {name}:\n{f.read()[-1500:]}")
    return "\n".join(tails) or "(no dashboard_agent log found)"


TWO_NODE_LOCK = os.path.join(tempfile.gettempdir(), "stacx-test-two-node-cluster.lock")
"""One two-node cluster at a time on this machine: two test modules use this fixture, and on two pytest
workers their four Ray nodes at once starve each other past Ray's fixed 30 s node-start limit."""


@contextlib.contextmanager
def _machine_wide_lock(path: str, timeout_s: float):
    """Hold an exclusive lock on `path` (shared by every process on this machine), waiting at most `timeout_s`."""
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another test held {path} (its two-node Ray cluster) for over {timeout_s:.0f} s")
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def two_node_cluster():
    with _machine_wide_lock(TWO_NODE_LOCK, timeout_s=1200):
        yield from _two_node_cluster()


def _two_node_cluster():
    temp_dir = tempfile.mkdtemp(prefix="stacx-ray-")  # short: Ray's socket paths must stay < 108 chars
    # Its daemons poll as a local cluster's do (LEAN_DAEMON_ENV: no metrics export, slow psutil sweeps) and
    # prestart no workers: the cluster lives through both tests (docs/testing.md, session 12).
    env = {**os.environ, **LEAN_DAEMON_ENV, **NO_IDLE_WORKERS_ENV, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("RAY_ADDRESS", None)
    sessions = []

    def start(name: str, make_args) -> str:
        """`ray start --block` with `make_args()`; returns its log. Ray gives a new node a fixed 30 s to
        register with the GCS and then exits ("timed out during startup"), which a loaded 2-core machine can
        exceed: that one failure is retried, on fresh ports, at most NODE_START_ATTEMPTS times."""
        for attempt in range(1, NODE_START_ATTEMPTS + 1):
            log_path = os.path.join(temp_dir, f"{name}-{attempt}.log")
            # Warm: the node's Python workers (the cluster check's ranks, the job's driver and role workers) are
            # then warm too. SIGTERM to the client reaches `ray start`; SIGKILL ends the process group it leads.
            process = subprocess.Popen([warm_python(), RAY, "start", "--block", *make_args()], env=env,
                                       start_new_session=True,
                                       stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
            sessions.append(process)
            try:
                _wait_for_line(log_path, "Ray runtime started", process, timeout_s=120)
                return log_path
            except RuntimeError as err:
                _stop_sessions([process])
                sessions.remove(process)
                if RAY_NODE_START_TIMED_OUT not in str(err) or attempt == NODE_START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    ports = {}

    def head_args() -> list[str]:
        ports.update(gcs=_free_port(), dashboard=_free_port())
        return ["--head", f"--port={ports['gcs']}", "--num-cpus=2", '--resources={"node_a": 2}',
                f"--object-store-memory={OBJECT_STORE_BYTES}", "--include-dashboard=true",
                "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}", f"--temp-dir={temp_dir}",
                f"--ray-client-server-port={_free_port()}", *_private_agent_ports(), "--disable-usage-stats"]

    try:
        with open(start("head", head_args)) as f:
            head_log = f.read()
        address = next(line.split("--address='")[1].split("'")[0] for line in head_log.splitlines()
                       if "ray start --address=" in line)
        start("node_b", lambda: [f"--address={address}", "--num-cpus=2", '--resources={"node_b": 2}',
                                 f"--object-store-memory={OBJECT_STORE_BYTES}", *_private_agent_ports(),
                                 "--disable-usage-stats"])
        dashboard_port = ports["dashboard"]
        dashboard = f"http://127.0.0.1:{dashboard_port}"
        # "Ray runtime started" comes before the head's job agent registers; a job submitted in
        # between fails with "No available agent". Poll with a real (trivial) job, bounded.
        try:
            wait_until_jobs_are_accepted(RAY, dashboard, env=env, timeout_s=240)
        except JobAgentNotReadyError as err:
            raise JobAgentNotReadyError(f"{err}\n{_agent_log_tails(temp_dir)}") from err
        yield {"address": address, "dashboard": dashboard, "env": env}
    finally:
        _stop_sessions(sessions)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _check_result(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"no {RESULT_PREFIX} line in:\n{output[-3000:]}"
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert result["ok"] is True
    # Rank 0 on node_a, rank 1 on node_b: two different Ray nodes.
    assert len(set(result["node_ids"])) == 2, result
    expected = (rank_contribution(0) + rank_contribution(1)).tolist()  # TP=2 spans both ranks
    assert result["tp_sums"] == [expected, expected]
    assert result["world_sum"] == expected
    return result


def test_one_role_spans_two_nodes_and_runs_collectives(two_node_cluster):
    completed = subprocess.run(
        [warm_python(), "-m", "stacx.trainer.cluster.ray.cluster_check", f"--ray-address={two_node_cluster['address']}",
         "--num-ranks=2", "--tp=2", "--bundle-resources=node_a,node_b"],
        env=two_node_cluster["env"], capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = _check_result(completed.stdout)
    assert result["attached_to"] == two_node_cluster["address"]


# GRPO through `stacx train` on the same cluster (it lives here to share the module's two-node cluster:
# starting one costs 80-110 s on two cores).

def _series(metrics_path: str, name: str) -> list[float]:
    with open(metrics_path) as handle:
        return [json.loads(line)[name] for line in handle]


def _grpo_two_node_command(checkpoint: str, out: str) -> list[str]:
    # Two ranks of 2 CPUs each on nodes of 2 CPUs: one rank per node.
    return ["-m", "stacx.train", "--algorithm", "grpo", "--hf-checkpoint", checkpoint, "--prompt-data",
            "builtin:sorting", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "6", "--rollout-engine", "cpu", "--num-steps", "2", "--lr", "1e-4",
            "--data-parallel-size", "2", "--num-cpus-per-rank", "2", "--out", out, "--no-progress-bar",
            "--no-plots"]


def _role_worker_nodes(dashboard: str, env: dict) -> dict[str, str]:
    """actor id -> node id of every RoleWorker the cluster has seen (the state API lists them in no
    particular order, so runs are told apart by actor id)."""
    script = ("import json; from ray.util.state import list_actors; "
              f"print(json.dumps({{a.actor_id: a.node_id for a in list_actors(address={dashboard!r}, limit=1000, "
              "filters=[('class_name', '=', 'RoleWorker')], detail=True)}))")
    completed = subprocess.run([warm_python(), "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _train_grpo_and_check_both_nodes(launch: list[str], two_node_cluster, out: str) -> None:
    """Run `launch` (a command that runs `stacx train` GRPO into `out`) and check that it trained 2 steps
    on 2 new RoleWorkers, one per node (the module's other tests leave RoleWorker actors of their own on
    this cluster: only new ones count)."""
    env = dict(two_node_cluster["env"], TOKENIZERS_PARALLELISM="false")
    before = _role_worker_nodes(two_node_cluster["dashboard"], env)
    completed = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    after = _role_worker_nodes(two_node_cluster["dashboard"], env)
    new_nodes = [node for actor, node in after.items() if actor not in before]
    assert len(new_nodes) == 2 and len(set(new_nodes)) == 2, after
    rewards = _series(os.path.join(out, "metrics.jsonl"), "rollout/reward_mean")
    losses = _series(os.path.join(out, "metrics.jsonl"), "policy/loss")
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards) and all(l == l for l in losses)


@pytest.fixture(scope="module")
def sorting_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("init") / "sorting"), "sorting", seed=0)


def test_ray_job_submit_runs_a_stacx_entry_on_the_cluster(two_node_cluster, sorting_checkpoint, tmp_path):
    """`stacx train` submitted with `ray job submit` and no --ray-address: it must attach to the job's
    cluster through the RAY_ADDRESS the job sets (a new local cluster would put both ranks on one node),
    and its two data-parallel ranks train on workers of both nodes."""
    out = str(tmp_path / "submitted")
    _train_grpo_and_check_both_nodes(
        [warm_python(), RAY, "job", "submit", f"--address={two_node_cluster['dashboard']}", "--",
         warm_python(), *_grpo_two_node_command(sorting_checkpoint, out)],
        two_node_cluster, out)
