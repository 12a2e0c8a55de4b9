"""Local Ray clusters started by `connect_ray` live on loopback: node addresses and listening sockets, also
those of a role's own torch.distributed world set up on it (tests/trainer/cluster/test_role_world_binding.py
checks the same world on a non-loopback address)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from stacx.testing.listening_sockets import descendant_pids, listening_addresses
from stacx.trainer.cluster.ray import connect as ray_cluster
from stacx.trainer.cluster.ray.connect import LOOPBACK_ADDRESS, connect_ray, is_loopback_address, node_addresses
from tests.warm import warm_python, warm_servers_of_in_process_drivers

pytestmark = pytest.mark.slow
LOOPBACK_FORMS = {LOOPBACK_ADDRESS, "::ffff:127.0.0.1"}  # the second: an IPv4 listener on an IPv6 socket
ATTACH_SCRIPT = """
import sys
import ray
from stacx.trainer.cluster.ray.connect import connect_ray
connection = connect_ray(sys.argv[1], log_to_driver=False)
print("ATTACHED", ray.util.get_node_ip_address(), ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120))
connection.shutdown()
"""


def _worker_node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _as_received(tensors: list) -> list:
    return [(tensor, tensor.is_contiguous()) for tensor in tensors]


def _worker_niceness() -> int:
    return os.nice(0)


def test_a_local_cluster_reports_and_listens_on_loopback_only(monkeypatch):
    """The cluster's processes, then a 2-rank role world on it (one cluster start for both). Its Python workers
    start warm (tests/warm.py)."""
    import ray
    from ray._private import ray_constants

    warm_servers_of_in_process_drivers(monkeypatch)  # the raylet starts workers with this `sys.executable`
    switch_before = ray_constants.ENABLE_RAY_CLUSTER
    connection = connect_ray(num_cpus=2, object_store_memory_bytes=80 * 1024 * 1024, log_to_driver=False,
                             environ={})
    try:
        assert connection.started_locally
        assert node_addresses() == [LOOPBACK_ADDRESS]
        assert ray.util.get_node_ip_address() == LOOPBACK_ADDRESS
        assert ray.get(ray.remote(_worker_node_address).remote(), timeout=120) == LOOPBACK_ADDRESS
        # Its workers run at this driver's priority, not Ray's default of 15 lower (WORKER_NICENESS_INCREMENT).
        assert ray.get(ray.remote(_worker_niceness).remote(), timeout=120) == os.nice(0)
        # Tensors this driver sends arrive through the raw-bytes transport (trainer/cluster/ray/tensor_transport.py).
        sent = [torch.randn(4, 3).to(torch.bfloat16), torch.arange(20)[::3], torch.tensor(True)]
        arrived = ray.get(ray.remote(_as_received).remote(sent), timeout=120)
        assert all(contiguous and torch.equal(a, b) and a.dtype == b.dtype for (a, contiguous), b in zip(arrived, sent))
        assert ray_constants.ENABLE_RAY_CLUSTER == switch_before  # the switch is restored after ray.init
        # What the kernel says, not what Ray says: the GCS, raylet, agents and workers (all started
        # below this process; the warm workers below the zygote this process started) listen on loopback
        # and never on 0.0.0.0 / ::.
        addresses = listening_addresses(pids=descendant_pids())
        assert addresses and addresses <= LOOPBACK_FORMS, addresses
        # Another driver attaches by the loopback address (as the tests' runs and `--ray-address` do);
        # Ray alone would rewrite 127.0.0.1 to the host's interface address, where nothing listens.
        attached = subprocess.run([warm_python(), "-c", ATTACH_SCRIPT, ray.get_runtime_context().gcs_address],
                                  capture_output=True, text=True, timeout=240)
        assert f"ATTACHED {LOOPBACK_ADDRESS} 42" in attached.stdout, attached.stdout[-2000:] + attached.stderr[-2000:]
        _check_a_role_world_listens_on_loopback_only()
    finally:
        connection.shutdown()


def _check_a_role_world_listens_on_loopback_only() -> None:
    """A 2-rank role set up on this cluster: its collective works over loopback, its rendezvous store's port
    is on 127.0.0.1 alone (torch's `tcp://` rendezvous listened on 0.0.0.0 / ::), and no socket its worker
    processes listen on (Ray's own, the store, gloo's devices) is outside loopback."""
    from stacx.trainer.cluster.ray import PlacedPool, ResourcePool, RolePlacement, RoleWorkers
    from tests.trainer.cluster.test_role_world_binding import LOOPBACK_FORMS as WORLD_LOOPBACK_FORMS
    from tests.trainer.cluster.test_role_world_binding import TIMEOUT_S, _world_facts

    pool = PlacedPool.create(ResourcePool(name="binding", num_bundles=2, num_cpus_per_bundle=0.5))
    workers = None
    try:
        workers = RoleWorkers("policy", 2, RolePlacement(pool), collective_timeout_s=TIMEOUT_S, user_modules=())
        workers.setup()
        facts = workers.execute_all(_world_facts)
        assert [f["sum"] for f in facts] == [3.0, 3.0]  # the world works
        assert {f["gloo_interface"] for f in facts} == {"lo"}
        store_addresses = listening_addresses(port=facts[0]["port"])
        assert store_addresses == {"127.0.0.1"}, store_addresses
        addresses = listening_addresses(pids={f["pid"] for f in facts})
        assert addresses and addresses <= WORLD_LOOPBACK_FORMS, addresses
    finally:
        if workers is not None:
            workers.shutdown()
        pool.remove()


def test_a_cluster_on_another_address_is_shut_down_and_named(monkeypatch):
    import ray
    from ray._private import ray_constants

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append((kwargs, ray_constants.ENABLE_RAY_CLUSTER)))
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": "192.0.2.7"}])
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(RuntimeError, match=r"node addresses \['192.0.2.7'\] instead of 127.0.0.1.*--ray-address"):
        ray_cluster.start_local_cluster(num_cpus=1)
    (kwargs, switch_during_init), shutdown = calls
    assert kwargs == {"_node_ip_address": LOOPBACK_ADDRESS, "num_cpus": 1,
                      "_system_config": {"worker_niceness": 0}} and switch_during_init is False
    assert shutdown == "shutdown"


def test_a_local_start_that_ray_abandons_is_retried_then_named(monkeypatch):
    import ray

    calls = []

    def init_timing_out(failures):
        def init(**kwargs):
            calls.append("init")
            if calls.count("init") <= failures:
                raise Exception("The current node timed out during startup. This could happen because ...")
        return init

    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": LOOPBACK_ADDRESS}])
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "init", init_timing_out(1))
    ray_cluster.start_local_cluster(num_cpus=1)  # the second attempt starts
    assert calls == ["init", "shutdown", "init"]
    calls.clear()
    monkeypatch.setattr(ray, "init", init_timing_out(ray_cluster.LOCAL_START_ATTEMPTS))
    with pytest.raises(RuntimeError, match=r"did not start: .* 2 times .*too busy.*--ray-address 127.0.0.1:6379.*torchrun"):
        ray_cluster.start_local_cluster(num_cpus=1)
    assert calls == ["init", "shutdown", "init", "shutdown"]
    # Any other failure of ray.init is Ray's own, raised at once.
    calls.clear()
    monkeypatch.setattr(ray, "init", lambda **kwargs: (_ for _ in ()).throw(ValueError("bad num_cpus")))
    with pytest.raises(ValueError, match="bad num_cpus"):
        ray_cluster.start_local_cluster(num_cpus=1)
    assert calls == []


def test_loopback_cluster_addresses_are_recognized():
    assert all(map(is_loopback_address, ["127.0.0.1:6379", "localhost:6379", "[::1]:6379", "127.0.0.2:1"]))
    assert not any(map(is_loopback_address, ["10.0.0.1:6379", "node-a:6379", "auto", "ray://127.0.0.1:10001"]))
