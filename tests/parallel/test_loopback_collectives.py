"""A single-process world's gloo groups listen on loopback only (`collectives_on_loopback`), even where
the host's gloo default (GLOO_SOCKET_IFNAME or the host name) is a network interface: `stacx serve`'s CPU
engine builds about twenty such groups, each a listening socket."""

from __future__ import annotations

import os
import socket

from stacx.parallel.node_interface import _ipv4_address_of, collectives_on_loopback
from stacx.testing.distributed import run_forked

def listening_addresses_of_a_world_of_one() -> list[str]:
    """In a process of its own: build a one-rank world and one more group inside `collectives_on_loopback`,
    then the IPv4 addresses of every TCP socket this process listens on (from the kernel's table)."""
    import torch.distributed as dist

    given = os.environ.get("GLOO_SOCKET_IFNAME")
    with collectives_on_loopback():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.new_group([0])
    assert os.environ.get("GLOO_SOCKET_IFNAME") == given, os.environ.get("GLOO_SOCKET_IFNAME")
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for line in list(open("/proc/net/tcp"))[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # a listening socket of this process
            addresses.append(socket.inet_ntoa(bytes.fromhex(fields[1].split(":")[0])[::-1]))
    return addresses


def network_interface() -> str | None:
    """An interface with an IPv4 address other than loopback, where one exists."""
    for _, name in socket.if_nameindex():
        address = _ipv4_address_of(name)
        if address and not address.startswith("127."):
            return name
    return None


def test_a_world_of_one_listens_on_loopback_where_gloo_would_use_a_network_interface():
    # A process forked from the rank forkserver (torch imported, no process group yet) with only the
    # interface in its environment.
    given = network_interface() or "lo"
    addresses = run_forked(listening_addresses_of_a_world_of_one,
                           environ={"GLOO_SOCKET_IFNAME": given, "PATH": "/usr/bin:/bin"})
    assert len(addresses) >= 2 and set(addresses) == {"127.0.0.1"}, (given, addresses)


def test_the_users_interface_choice_is_restored_after_the_world_is_built():
    environ = {"GLOO_SOCKET_IFNAME": "eth7"}
    with collectives_on_loopback(environ) as interface:
        assert environ["GLOO_SOCKET_IFNAME"] == interface == "lo"
    assert environ == {"GLOO_SOCKET_IFNAME": "eth7"}
    environ = {}
    with collectives_on_loopback(environ):
        pass
    assert environ == {}
