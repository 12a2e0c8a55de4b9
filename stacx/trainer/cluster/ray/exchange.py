"""Exchange groups, driver side: `ExchangeSyncGroup` connects two roles' workers and runs transfers.

The protocol (stores, secrets, buckets, headers) is described in `exchange_endpoint`, the worker side.
"""

from __future__ import annotations

import functools
import secrets
from typing import Any, Callable, Sequence

from stacx.trainer.cluster.ray.group import consume_on_worker, produce_on_worker
from stacx.trainer.cluster.ray.exchange_endpoint import DEFAULT_BUCKET_BYTES, SECRET_BYTES
from stacx.trainer.cluster.ray.role_worker import RoleWorker
from stacx.trainer.cluster.ray.role_workers import PendingCall, wait_all


class ExchangeSyncGroup:
    """Driver side of an exchange sync between a source role and a target role.

        sync = ExchangeSyncGroup("policy_to_ref", policy_workers, ref_workers)
        sync.connect()
        results = sync.transfer(produce=state_dict_of_model, consume=load_into_model)

    Target rank j receives from source rank `sources_by_target[j]` (default `j % S`, which pairs
    equal tensor-parallel ranks when both roles use the same TP layout). `produce` runs on every
    source rank, `consume(worker, tensors)` on every target rank; `transfer` returns the consume
    results in target rank order. Failures and timeouts name the role and rank.
    """

    def __init__(self, name: str, source, target, *, backend: str = "auto", timeout_s: float | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if source is target or source.role_name == target.role_name:
            raise ValueError(f"exchange sync {name!r}: source and target must be different roles, "
                             f"got {source.role_name!r} twice")
        self.name = name
        self.source = source
        self.target = target
        self.backend = backend
        self.timeout_s = timeout_s if timeout_s is not None else max(source.collective_timeout_s,
                                                                     target.collective_timeout_s)
        self.bucket_bytes = bucket_bytes
        self.resolved_backends: list[str] = []
        self._secret = secrets.token_bytes(SECRET_BYTES)
        """Authenticates transfer headers; handed to the members in `open_exchange`, never to the store."""
        self._next_transfer_id = 0
        self._connected = False

    @property
    def group_size(self) -> int:
        return self.source.num_ranks + self.target.num_ranks

    def connect(self) -> None:
        """Create the group on every worker of both roles (source ranks first)."""
        host, port = self.source.execute_rank0(RoleWorker.host_exchange_store, self.name, self.timeout_s,
                                               timeout_s=self.timeout_s)
        calls = []
        for role, offset in ((self.source, 0), (self.target, self.source.num_ranks)):
            refs = [
                actor.open_exchange.remote(self.name, offset + rank, self.group_size, host, port,
                                           secret=self._secret, backend=self.backend, timeout_s=self.timeout_s)
                for rank, actor in enumerate(role.actors)
            ]
            calls.append(PendingCall(refs, role.labels, self.timeout_s + 60.0, f"open exchange {self.name!r}"))
        source_backends, target_backends = wait_all(*calls, what=f"opening exchange group {self.name!r}")
        self.resolved_backends = source_backends + target_backends
        if len(set(self.resolved_backends)) != 1:
            raise RuntimeError(f"exchange sync {self.name!r}: workers resolved different backends "
                               f"{self.resolved_backends}; pass backend='gloo' or 'nccl' explicitly")
        self._connected = True

    def default_sources_by_target(self) -> list[int]:
        return [rank % self.source.num_ranks for rank in range(self.target.num_ranks)]

    def transfer(self, produce: Callable[..., Any], consume: Callable[..., Any], *,
                 sources_by_target: list[int] | None = None) -> list[Any]:
        """Move `produce`'s tensors from the source ranks to the target ranks; returns consume results."""
        if not self._connected:
            raise RuntimeError(f"exchange sync {self.name!r}: call connect() before transfer()")
        mapping = list(sources_by_target) if sources_by_target is not None else self.default_sources_by_target()
        if len(mapping) != self.target.num_ranks or not all(0 <= s < self.source.num_ranks for s in mapping):
            raise ValueError(
                f"exchange sync {self.name!r}: sources_by_target must give a source rank in "
                f"[0, {self.source.num_ranks}) for each of the {self.target.num_ranks} target ranks, got {mapping}"
            )
        transfer_id = self._next_transfer_id
        self._next_transfer_id += 1
        offset = self.source.num_ranks
        send_refs = [
            actor.exchange_send.remote(self.name, transfer_id, produce,
                                       [offset + j for j, s in enumerate(mapping) if s == rank], self.bucket_bytes)
            for rank, actor in enumerate(self.source.actors)
        ]
        receive_refs = [
            actor.exchange_receive.remote(self.name, transfer_id, consume, mapping[rank])
            for rank, actor in enumerate(self.target.actors)
        ]
        what = f"exchange sync {self.name!r} ({self.source.role_name} -> {self.target.role_name})"
        # Producing may itself take a while (gathering shards): allow it on top of the transfer.
        deadline = 2 * self.timeout_s
        _, consumed = wait_all(PendingCall(send_refs, self.source.labels, deadline, what),
                               PendingCall(receive_refs, self.target.labels, deadline, what), what=what)
        return consumed

    def transfer_payloads(self, keys: Sequence[str], *, sources_by_target: Sequence[int] | None = None) -> list[dict[str, int]]:
        """Move the named `ExchangePayload`s (stacx.trainer.runtime.exchange_payloads) between the roles'
        runtimes; per target rank, {key: tensors consumed}."""
        keys = tuple(keys)
        return self.transfer(functools.partial(produce_on_worker, keys=keys),
                             functools.partial(consume_on_worker, keys=keys),
                             sources_by_target=None if sources_by_target is None else list(sources_by_target))

    def close(self) -> None:
        if not self._connected:
            return
        for role in (self.source, self.target):
            try:
                role.execute_all(RoleWorker.close_exchange, self.name, timeout_s=30.0)
            except Exception:  # noqa: BLE001 - teardown after a failure
                pass
        self._connected = False
