"""A single-process world's gloo groups listen on loopback only (`collectives_on_loopback`), even where
the host's gloo default (GLOO_SOCKET_IFNAME or the host name) is a network interface: `stacx serve`'s CPU
engine builds about twenty such groups, each a listening socket."""

from __future__ import annotations

import socket
import subprocess
import sys

from stacx.parallel.node_interface import _ipv4_address_of, collectives_on_loopback

WORLD_OF_ONE = """
import os, socket, torch.distributed as dist
from stacx.parallel.node_interface import collectives_on_loopback
with collectives_on_loopback():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.new_group([0])
assert os.environ.get("GLOO_SOCKET_IFNAME") == {given!r}, os.environ.get("GLOO_SOCKET_IFNAME")
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:  # the listing's own descriptor, closed by now
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
for line in list(open("/proc/net/tcp"))[1:]:
    fields = line.split()
    if fields[3] == "0A" and fields[9] in inodes:  # a listening socket of this process
        address = fields[1].split(":")[0]
        print(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
"""


def network_interface() -> str | None:
    """An interface with an IPv4 address other than loopback, where one exists."""
    for _, name in socket.if_nameindex():
        address = _ipv4_address_of(name)
        if address and not address.startswith("127."):
            return name
    return None


def test_a_world_of_one_listens_on_loopback_where_gloo_would_use_a_network_interface():
    given = network_interface() or "lo"
    completed = subprocess.run([sys.executable, "-c", WORLD_OF_ONE.format(given=given)], capture_output=True,
                               text=True, timeout=120, env={"GLOO_SOCKET_IFNAME": given, "PATH": "/usr/bin:/bin"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    addresses = completed.stdout.split()
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
