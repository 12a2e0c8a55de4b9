"""Exchange groups, worker side: one worker's `ExchangeEndpoint` (the driver side is `exchange.ExchangeSyncGroup`).

Exchange syncs move tensors (e.g. weights) between two roles' workers, bit for bit.

Design. Each role's workers form their own torch.distributed world (the default process group
and megatron-core's groups live in it), so two roles cannot share a `new_group`. An exchange
group is therefore a second, independent process group built directly from a store:

1. The source role's rank 0 hosts a `TCPStore` on a free port of its node's cluster address
   (`host_store`; the address Ray uses for the node, 127.0.0.1 on a local cluster, never
   0.0.0.0). The driver draws a per-group secret (`secrets.token_bytes(32)`) and hands it to
   every member in its `open_exchange` call; it never goes through the store.
2. Every worker of both roles connects to it and constructs the backend on a
   `PrefixStore("stacx-exchange/<name>")`: `ProcessGroupGloo` on CPU (its device bound to the
   worker's node address), `ProcessGroupNCCL` on GPU.
   Group ranks are the source role's ranks 0..S-1 followed by the target role's S..S+T-1.
   No `init_process_group` is involved, so the roles' own worlds are untouched.
3. A transfer: every source rank runs the driver-shipped `produce(worker)` (collectively, so it
   may gather TP shards) and gets an ordered `{name: tensor}`. A source rank publishes a header
   (names, dtypes from a closed table, shapes, byte ranges: JSON with an HMAC under the group's
   secret, see `exchange_header`; never pickle) in the store under the transfer's id, packs the
   tensors' raw bytes into uint8 buckets of at most `bucket_bytes` (each tensor starting at a 64-byte aligned
   offset; a tensor larger than a bucket gets a bucket of its own) and sends each bucket to
   every target rank mapped to it. A target rank reads the header, refuses it unless its HMAC
   checks out (a process without the secret cannot announce tensors), receives the buckets and
   views each tensor back out of them, then runs `consume(worker, tensors)`.

Bytes travel, never values, so every dtype (bf16, fp8, int, bool, NaN payloads) arrives
bitwise-identical. The store and every send/recv use the group's timeout, so a peer that dies
fails the transfer instead of hanging it.

Colocated roles on one GPU must use gloo (NCCL refuses two ranks on the same device); the
factory picks gloo for them. On GPU with NCCL, buckets live on the current CUDA device.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from stacx.parallel.bound_store import gloo_options, host_bound_store
from stacx.parallel.tensor_buckets import pack_bucket, plan_buckets, unpack_bucket
from stacx.trainer.cluster.ray.exchange_header import check_secret, decode_header, encode_header

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
"""Bucket size: hundreds of MB per message is what keeps large weight syncs fast."""
STORE_PREFIX = "stacx-exchange"
SECRET_BYTES = 32
"""Length of the per-group secret the driver draws."""


def resolve_backend(backend: str) -> str:
    """'auto' -> 'nccl' when CUDA is usable in this process, else 'gloo'."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"exchange: backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def host_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Start an exchange group's store on a free port of address `host` only (see `parallel.bound_store`)."""
    return host_bound_store(host, timeout_s, purpose="exchange")


class ExchangeEndpoint:
    """One worker's membership in an exchange group (see the module docstring for the protocol).

    `host:port` is the group's store, `local_host` this worker's node address (gloo listens
    there), `secret` the group's per-run secret that authenticates transfer headers.
    """

    def __init__(self, name: str, group_rank: int, group_size: int, host: str, port: int, *,
                 secret: bytes, local_host: str, backend: str, timeout_s: float,
                 hosted_store: dist.TCPStore | None = None):
        self.name = name
        self._secret = check_secret(secret, f"exchange group {name!r}")
        self.group_rank = group_rank
        self.group_size = group_size
        self.backend = resolve_backend(backend)
        self.timeout = timedelta(seconds=timeout_s)
        base_store = hosted_store or dist.TCPStore(host, port, None, False, self.timeout)
        self._base_store = base_store
        self.store = dist.PrefixStore(f"{STORE_PREFIX}/{name}", base_store)
        # The constructor is a rendezvous through the store: every member must be constructing it.
        if self.backend == "gloo":
            self.device = torch.device("cpu")
            self.process_group = dist.ProcessGroupGloo(self.store, group_rank, group_size,
                                                       gloo_options(local_host, self.timeout))
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.process_group = dist.ProcessGroupNCCL(self.store, group_rank, group_size, options)

    def send(self, transfer_id: int, tensors: Mapping[str, torch.Tensor], dst_group_ranks: list[int],
             bucket_bytes: int) -> int:
        """Send `tensors` to every rank in `dst_group_ranks`; returns the bytes sent per destination."""
        slots, sizes = plan_buckets(tensors, bucket_bytes)
        key = self.header_key(transfer_id, self.group_rank)
        self.store.set(key, encode_header(self._secret, self._authenticated_key(key), slots))
        for bucket, size in enumerate(sizes):
            if size == 0:  # only empty tensors: nothing to send (the receiver skips it too)
                continue
            buffer = pack_bucket(tensors, slots, bucket, size, self.device)
            works = [self.process_group.send([buffer], dst, bucket) for dst in dst_group_ranks]
            for work in works:
                work.wait()
        return sum(sizes)

    def receive(self, transfer_id: int, src_group_rank: int) -> dict[str, torch.Tensor]:
        """Receive what rank `src_group_rank` sends under `transfer_id`, in its original order."""
        # store.get waits (up to the group's timeout) for the sender to publish the header.
        key = self.header_key(transfer_id, src_group_rank)
        slots = decode_header(self._secret, self._authenticated_key(key), self.store.get(key))
        num_buckets = 1 + max((slot.bucket for slot in slots), default=-1)
        sizes = [max((s.offset + s.num_bytes for s in slots if s.bucket == b), default=0) for b in range(num_buckets)]
        received: dict[str, torch.Tensor] = {}
        for bucket, size in enumerate(sizes):
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                self.process_group.recv([buffer], src_group_rank, bucket).wait()
            received.update(unpack_bucket(buffer, slots, bucket))
        return {slot.name: received[slot.name] for slot in slots}

    @staticmethod
    def header_key(transfer_id: int, src_group_rank: int) -> str:
        """The store key (under the group's prefix) of source rank `src_group_rank`'s header."""
        return f"{transfer_id}/meta/{src_group_rank}"

    def _authenticated_key(self, key: str) -> str:
        # The MAC covers the group name as well, so a header cannot move to another group either.
        return f"{STORE_PREFIX}/{self.name}/{key}"

    def close(self) -> None:
        try:
            self.process_group.shutdown()
        except Exception:  # noqa: BLE001 - a peer may already be gone
            pass
