"""A role's own torch.distributed world listens on the node's cluster address only.

Read from the kernel's socket tables, not from torch's API. On a local (loopback) Ray cluster: the
check runs in the cluster's own test (tests/trainer/cluster/test_ray_cluster.py, one cluster start for
both) with `_world_facts` below. Here: a 2-rank world joined on a non-loopback address of this machine
listens there, not where the host name resolves to.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp

from stacx.testing.listening_sockets import listening_addresses
from stacx.parallel.node_interface import (
    _ipv4_address_of,
    bind_collectives_to_node,
    interface_for_address,
    local_address_toward,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

LOOPBACK_FORMS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
WILDCARDS = {"0.0.0.0", "::"}
TIMEOUT_S = 60.0


def _world_facts(worker) -> dict:
    """What a set-up worker can tell about its world: its pid, store port, gloo interface, a collective."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([worker.rank + 1.0])
    dist.all_reduce(value)
    return {"pid": os.getpid(), "port": int(os.environ["MASTER_PORT"]), "sum": value.item(),
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME")}


def test_only_rank_zero_hosts_and_rank_zero_needs_its_store():
    from stacx.trainer.cluster.ray.role_worker import RoleWorker, join_role_world

    with pytest.raises(ValueError, match="host_rendezvous runs on rank 0, not rank 1"):
        RoleWorker("policy", 1, 2).host_rendezvous(5.0)
    with pytest.raises(ValueError, match="hosted_store"):
        join_role_world(0, 2, node_address="127.0.0.1", store_address="127.0.0.1", store_port=1, timeout_s=5.0)


# ---- gloo on a non-loopback node address --------------------------------------------------

def _non_loopback_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        address = _ipv4_address_of(name)
        if address and not address.startswith("127."):
            return address
    return None


@pytest.mark.slow
def test_gloo_listens_on_the_node_address_not_where_the_host_name_resolves():
    node_address = _non_loopback_ipv4()
    if node_address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind to")
    context = mp.get_context("spawn")
    port_queue, results, release = context.Queue(), context.Queue(), context.Event()
    processes = [context.Process(target=_hold_world, args=(rank, node_address, port_queue, results, release))
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        reports = sorted(results.get(timeout=120) for _ in range(2))
        assert [value for _, _, value in reports] == [2.0, 2.0]
        addresses = listening_addresses(pids={pid for _, pid, _ in reports})
        # Without GLOO_SOCKET_IFNAME gloo would listen where the host name resolves (often loopback).
        assert addresses == {node_address}, addresses
    finally:
        release.set()
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def _hold_world(rank: int, node_address: str, port_queue, results, release) -> None:
    """Join the world, report, and keep every socket open until the parent has looked."""
    import torch
    import torch.distributed as dist

    from stacx.trainer.cluster.ray.exchange_endpoint import host_store
    from stacx.trainer.cluster.ray.role_worker import join_role_world

    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.pop(variable, None)
    store, port = None, None
    if rank == 0:
        store, port = host_store(node_address, TIMEOUT_S)
        port_queue.put(port)
    else:
        port = port_queue.get(timeout=TIMEOUT_S)
    join_role_world(rank, 2, node_address=node_address, store_address=node_address, store_port=port,
                    hosted_store=store, timeout_s=TIMEOUT_S)
    value = torch.ones(1)
    dist.all_reduce(value)
    results.put((rank, os.getpid(), value.item()))
    release.wait(timeout=120)
    dist.destroy_process_group()


# ---- interface lookup ---------------------------------------------------------------------

def test_the_interface_of_an_address_is_found_and_a_user_choice_wins():
    assert interface_for_address("127.0.0.1") == "lo"
    assert interface_for_address("198.51.100.250") is None  # TEST-NET-2: held by no interface here
    with pytest.raises(ValueError, match="'node-1' is not an IP address"):
        interface_for_address("node-1")
    environ: dict[str, str] = {}
    assert bind_collectives_to_node("127.0.0.1", environ) == "lo"
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    chosen = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert bind_collectives_to_node("127.0.0.1", chosen) == "eth7"
    assert chosen == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "lo"}


def test_a_torchrun_rank_binds_to_its_address_toward_the_master():
    assert local_address_toward("127.0.0.1") == "127.0.0.1"
    assert local_address_toward("localhost") in LOOPBACK_FORMS
    node_address = _non_loopback_ipv4()
    if node_address is not None:  # a master on this host's own interface address is reached from it
        assert local_address_toward(node_address) == node_address
    with pytest.raises(OSError, match="MASTER_ADDR='no-such-host.invalid'"):
        local_address_toward("no-such-host.invalid")
