"""A torch.distributed `TCPStore` server that listens on one address only.

`TCPStore(host, port, is_master=True)` listens on every interface whatever `host` it is given, so
anyone who can reach the machine can join a process group's rendezvous. Every store Stacx hosts
(role worlds, exchange groups, SGLang's weight-update group, vLLM's gloo weight-transfer group) goes
through `host_bound_store`, which binds the listening socket to one address itself and hands it to the
store by file descriptor. Wildcard addresses (0.0.0.0, ::) are refused.

    store, port = host_bound_store(ray.util.get_node_ip_address(), timeout_s=300)
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")


def host_bound_store(host: str, timeout_s: float, *, port: int = 0, world_size: int | None = None,
                     purpose: str = "store") -> tuple[dist.TCPStore, int]:
    """Start a TCPStore server on `host:port` only (`port=0`: a free one); returns it and its port.

    `host` is the node's cluster address (`ray.util.get_node_ip_address()`, 127.0.0.1 on a local
    cluster). `world_size` None: the store does not wait for its clients. `purpose` names the
    store in error messages.
    """
    if host in WILDCARD_ADDRESSES:
        raise ValueError(f"{purpose}: a store must listen on the node's cluster address, got {host!r} "
                         "(every interface); pass ray.util.get_node_ip_address() or 127.0.0.1")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, port))
        listener.listen(128)
        bound_port = listener.getsockname()[1]
    except OSError as err:
        listener.close()
        raise OSError(f"{purpose}: cannot listen on {host!r} port {port}: {err}") from err
    # The store takes the socket over (and closes it with the store).
    store = dist.TCPStore(host, bound_port, world_size, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.detach())
    return store, bound_port


def gloo_options(local_host: str, timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """Gloo options whose one device listens on `local_host` (not on whatever the host name resolves to)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return options
