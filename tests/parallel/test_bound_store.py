"""host_bound_store listens on the one address it is given (read from the kernel's socket tables)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from stacx.parallel.bound_store import host_bound_store
from stacx.rollout.engines.sglang import WeightBroadcastGroup
from stacx.testing.distributed import find_free_port
from stacx.testing.listening_sockets import listening_addresses

LOOPBACK = "127.0.0.1"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_wildcard_addresses_are_refused_naming_the_purpose(wildcard):
    with pytest.raises(ValueError, match="SGLang weight-update group: a store must listen on the node's"):
        host_bound_store(wildcard, 5.0, purpose="SGLang weight-update group")


def test_a_requested_port_is_bound_on_the_given_address_only():
    port = find_free_port()
    store, bound_port = host_bound_store(LOOPBACK, 5.0, port=port)
    assert bound_port == port
    assert listening_addresses(port=port) == {LOOPBACK}
    store.set("k", b"v")
    assert dist.TCPStore(LOOPBACK, port, is_master=False).get("k") == b"v"


def test_sglang_weight_broadcast_group_hosts_its_store_on_the_master_address_only():
    # World of one: rank 0 alone, gloo; what matters is where its store listens.
    port = find_free_port()
    group = WeightBroadcastGroup(master_address=LOOPBACK, master_port=port, world_size=1, backend="gloo", timeout_s=30)
    assert listening_addresses(port=port) == {LOOPBACK}  # torch's own TCPStore would listen on every interface
    tensor = torch.arange(4.0)
    group.broadcast(tensor)
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="every interface"):
        WeightBroadcastGroup(master_address="0.0.0.0", master_port=find_free_port(), world_size=1, backend="gloo")
