"""Address facts shared by the servers, the engines and the Ray connection."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """True for a host only this machine can reach (127.0.0.0/8, ::1, 'localhost'); False for a
    wildcard (0.0.0.0, ::), any other address, or a name that is not 'localhost'."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
