"""Which addresses TCP sockets listen on, read from the kernel's tables (Linux `/proc`).

Security tests use this to prove that a server binds to loopback or the cluster address and not
to every interface (0.0.0.0 / ::), whatever the server's own API claims.

    listening_addresses(port=store.port)             # {"127.0.0.1"}
    listening_addresses(pids=descendant_pids())       # every address our child processes listen on
"""

from __future__ import annotations

import os
import socket
import sys

LISTEN_STATE = "0A"
_TABLES = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))


def _decode_address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":  # the kernel prints each 32-bit word in host byte order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def listening_sockets() -> list[tuple[str, int, int]]:
    """(address, port, socket inode) of every listening TCP socket of this network namespace."""
    if not os.path.exists(_TABLES[0][0]):
        raise RuntimeError(f"listening_sockets reads {_TABLES[0][0]}, which this system does not have (Linux only)")
    found = []
    for table, family in _TABLES:
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, port_hex = fields[1].rsplit(":", 1)
                if fields[3] == LISTEN_STATE:
                    found.append((_decode_address(address, family), int(port_hex, 16), int(fields[9])))
    return found


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open (empty when it is gone or not readable)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    except OSError:
        pass
    return inodes


def descendant_pids(pid: int | None = None) -> set[int]:
    """`pid` (default: this process) and every process below it."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may contain spaces
        children.setdefault(parent, []).append(int(entry))
    found, stack = set(), [root]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(children.get(current, []))
    return found


def listening_addresses(*, port: int | None = None, pids: set[int] | None = None) -> set[str]:
    """Addresses of the listening sockets on `port` and/or held by processes `pids`."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids)) if pids is not None else None
    return {address for address, socket_port, inode in listening_sockets()
            if (port is None or socket_port == port) and (inodes is None or inode in inodes)}
