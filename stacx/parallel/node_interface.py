"""Which network interface holds the node's cluster address, so gloo/NCCL listen there only.

torch's `init_process_group` and megatron-core's `new_group` build their gloo devices from the
environment: `GLOO_SOCKET_IFNAME` names the interface to listen on; without it gloo listens on
whatever address the host name resolves to (on many hosts the public interface, not the one Ray
uses). There is no per-group address for the default group, so a Ray worker sets the variable to
the interface holding its node address (`ray.util.get_node_ip_address()`) before it joins its
role's world: `lo` on a local cluster. NCCL's bootstrap reads `NCCL_SOCKET_IFNAME` the same way.
A torchrun rank uses the interface of its address toward `MASTER_ADDR` (`local_address_toward`).

A value the user exported already wins (they chose the interface); gloo then still listens on an
interface address, never on 0.0.0.0 / ::.

A world of one process (the CPU engine in `stacx serve` or the driver) talks to no other host: its
groups are built inside `collectives_on_loopback()`, so their gloo devices listen on loopback whatever
the host name resolves to (megatron-core's layout makes about twenty such groups, each a listening socket).

Linux only (ioctl and `/proc/net/if_inet6`); elsewhere `interface_for_address` returns None and
gloo keeps its default.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Iterator, MutableMapping

logger = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
"""Linux ioctl: the IPv4 address of an interface."""
IF_INET6_TABLE = "/proc/net/if_inet6"
COLLECTIVE_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables gloo and NCCL read for the interface they listen on."""


def _ipv4_address_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: name[16], then sockaddr_in (family, port, addr)


def _ipv6_addresses() -> dict[str, str]:
    """{address: interface} from the kernel's IPv6 table (empty when there is none)."""
    found = {}
    try:
        with open(IF_INET6_TABLE) as table:
            for line in table:
                fields = line.split()  # address (32 hex digits), index, prefix length, scope, flags, name
                if len(fields) == 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    except OSError:
        pass
    return found


def interface_for_address(address: str) -> str | None:
    """The name of the interface holding `address` (its primary IPv4 or any IPv6 address), else None."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError as err:
        raise ValueError(f"node address {address!r} is not an IP address (expected ray.util.get_node_ip_address())") from err
    if parsed.version == 6:
        return _ipv6_addresses().get(str(parsed))
    for _, name in socket.if_nameindex():
        if _ipv4_address_of(name) == str(parsed):
            return name
    return None


def local_address_toward(host: str, port: int = 9) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP `connect` only picks a route).

    On torchrun, `MASTER_ADDR` is on the cluster network, so the address toward it is this node's
    cluster address (127.0.0.1 when the master is local on loopback).
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as err:
        raise OSError(f"cannot find this host's address toward MASTER_ADDR={host!r}: {err}") from err


def bind_collectives_to_node(address: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Point gloo and NCCL at the interface holding `address`; returns the interface now in use (or None).

    Sets `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` in `environ` (default `os.environ`) unless set.
    """
    environ = os.environ if environ is None else environ
    interface = interface_for_address(address)
    if interface is None:
        logger.warning("no network interface holds the node address %s; gloo listens where the host name "
                       "resolves to (set GLOO_SOCKET_IFNAME to choose the interface)", address)
        return environ.get("GLOO_SOCKET_IFNAME")
    for variable in COLLECTIVE_INTERFACE_VARIABLES:
        environ.setdefault(variable, interface)
    return environ["GLOO_SOCKET_IFNAME"]


LOOPBACK_ADDRESS = "127.0.0.1"


@contextlib.contextmanager
def collectives_on_loopback(environ: MutableMapping[str, str] | None = None) -> Iterator[str | None]:
    """Within: gloo's new devices listen on the loopback interface (`GLOO_SOCKET_IFNAME`, the user's
    value included, is restored on exit). For a single-process world only: no other host could join it."""
    environ = os.environ if environ is None else environ
    interface = interface_for_address(LOOPBACK_ADDRESS)
    before = environ.get("GLOO_SOCKET_IFNAME")
    if interface is not None:
        environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield interface
    finally:
        if before is None:
            environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            environ["GLOO_SOCKET_IFNAME"] = before
