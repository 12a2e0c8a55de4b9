"""Weights into a running vLLM server through vLLM's own weight-transfer API (`--vllm-weight-transfer nccl|gloo`).

vLLM 0.32's server started with `--weight-transfer-config '{"backend": B}'` joins a collective group with the
trainer and takes each update as tensor metadata over HTTP plus the tensors broadcast from the trainer (rank 0
of the group). The sending trainer rank (TP, PP, CP and DP rank 0, after the TP/PP/EP gathers into Hugging Face
names: `RoleRuntime.push_weights_to_engine`) drives it, in this order (field names from vLLM 0.32's
`entrypoints/rl/online/api_router.py` and `distributed/weight_transfer/nccl_engine.py`):

    once:      GET  /get_world_size                -> {"world_size": W}      (the server's TP x PP x DP workers)
               POST /init_weight_transfer_engine   {"init_info": {...}}     while the trainer joins as rank 0 of 1 + W
    per push:  POST /start_weight_update           (no body)
               per bucket:
               POST /update_weights                {"update_info": {"names", "dtype_names", "shapes"}}
                                                   while the trainer broadcasts each tensor, in `names` order
               POST /finish_weight_update          (no body)
               POST /update_weight_version         {"new_version": "N"}

Backends (`TRANSFER_BACKENDS`, the flag's values):
- `nccl`: vLLM's NCCL engine, rendezvous by a unique id the trainer mints (`nccl_unique_id_b64`: the trainer
  needs no vLLM, only torch's NCCL; `stacx.parallel.weight_broadcast.NcclUniqueIdGroup`). Needs CUDA on the
  sending rank and on the server; refused on a CPU rank naming the flag.
- `gloo`: the same API and messages over gloo, for CPU servers and tests: the server's worker registers
  Stacx's engine `stacx_gloo` (`vllm_worker/stacx_gloo_transfer.py`), which joins a TCPStore the trainer hosts
  (`master_address`, `master_port`, as vLLM's NCCL engine's TCP rendezvous does).

Buckets are Stacx's (`WEIGHT_BUCKET_BYTES` of Hugging Face-named tensors): one `/update_weights` per bucket,
all inside one start/finish, which runs vLLM's layerwise reload once. A bucket holding NaN or infinity is
refused before any of its bytes are sent (the update is finished without a new version, so the engine keeps
serving the version it had: the driver's version check stops the run). The version rules (newer only) and
the record of the version served are the Stacx worker extension's (`VllmEngine`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from stacx.parallel.tensor_buckets import dtype_name
from stacx.parallel.weight_broadcast import NcclUniqueIdGroup, WeightBroadcastGroup
from stacx.wire.engine import WeightBucket
from stacx.wire.http_client import HttpTransport, RetryPolicy

FLAG = "--vllm-weight-transfer"
TRANSFER_RETRY = RetryPolicy(timeout_s=600.0, max_attempts=1)
"""A transfer call is never retried: the server is inside a collective the trainer must match exactly once."""
GLOO_GROUP_TIMEOUT_S = 600.0
"""Seconds the trainer's end of a gloo group waits for the server's workers to join, or for a broadcast."""
REFUSAL_GRACE_S = 30.0
"""When the trainer's side of a collective fails, seconds it waits for the server's answer, whose error (the server
refused the request before joining) is the cause to report."""


class WeightTransferRefused(ValueError):
    """A push refused before its bytes were sent (non-finite tensor, stale version, unready server)."""


class BroadcastGroup(Protocol):
    """The trainer's end (rank 0) of the group a vLLM server joins."""

    def join(self) -> None: ...

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class TransferBackend:
    """One way of sending weights through vLLM's weight-transfer API."""

    name: str
    """The value of --vllm-weight-transfer."""
    server_backend: str
    """vLLM's `--weight-transfer-config` backend the server must be started with."""
    open_group: Callable[..., BroadcastGroup]
    """open_group(rendezvous_host=..., world_size=...) -> the trainer's end, not yet joined."""
    init_info: Callable[..., dict]
    """init_info(group, world_size=..., rendezvous_host=...) -> the `init_info` of /init_weight_transfer_engine."""


def _open_nccl_group(*, rendezvous_host: str, world_size: int) -> BroadcastGroup:
    return NcclUniqueIdGroup(world_size=world_size,
                             what=f"{FLAG} nccl (on CPU use {FLAG} gloo, or the default, Stacx's own buckets)")


def _nccl_init_info(group: NcclUniqueIdGroup, *, world_size: int, rendezvous_host: str) -> dict:
    return {"rank_offset": 1, "world_size": int(world_size), "nccl_unique_id_b64": group.unique_id_b64,
            "packed": False}


def _open_gloo_group(*, rendezvous_host: str, world_size: int) -> BroadcastGroup:
    return WeightBroadcastGroup.hosted(master_address=rendezvous_host, world_size=world_size, backend="gloo",
                                       timeout_s=GLOO_GROUP_TIMEOUT_S)


def _gloo_init_info(group: WeightBroadcastGroup, *, world_size: int, rendezvous_host: str) -> dict:
    return {"master_address": rendezvous_host, "master_port": int(group.master_port), "rank_offset": 1,
            "world_size": int(world_size), "packed": False}


TRANSFER_BACKENDS: dict[str, TransferBackend] = {
    backend.name: backend for backend in (
        TransferBackend(name="nccl", server_backend="nccl", open_group=_open_nccl_group, init_info=_nccl_init_info),
        TransferBackend(name="gloo", server_backend="stacx_gloo", open_group=_open_gloo_group,
                        init_info=_gloo_init_info),
    )
}
"""--vllm-weight-transfer values that go through vLLM's weight-transfer API, by name."""


def transfer_backend(name: str) -> TransferBackend:
    try:
        return TRANSFER_BACKENDS[name]
    except KeyError:
        raise ValueError(f"{FLAG} {name!r}: vLLM's weight-transfer API is used with one of "
                         f"{sorted(TRANSFER_BACKENDS)}") from None


def weight_transfer_config_arg(name: str) -> list[str]:
    """The `vllm serve` flags of a server that takes weights over backend `name`."""
    return ["--weight-transfer-config", '{"backend": "%s"}' % transfer_backend(name).server_backend]


def build_update_info(bucket: WeightBucket) -> dict:
    """`/update_weights`'s body for one bucket: vLLM's `NCCLWeightTransferUpdateInfo` fields, in send order."""
    return {"update_info": {"names": [name for name, _ in bucket],
                            "dtype_names": [dtype_name(tensor.dtype, name) for name, tensor in bucket],
                            "shapes": [list(tensor.shape) for _, tensor in bucket]}}


def refuse_non_finite(bucket: WeightBucket, *, url: str, version: int) -> None:
    for name, tensor in bucket:
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            raise WeightTransferRefused(
                f"{url}: weight version {version} not sent: tensor {name!r} holds "
                f"{int((~torch.isfinite(tensor)).sum())} NaN or infinite values (the trainer's weights diverged)")


def _world_size(answer: Any, url: str) -> int:
    size = answer.get("world_size") if isinstance(answer, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise RuntimeError(f"{url}/get_world_size answered {str(answer)[:200]!r}, not a world size; is it vLLM 0.32's "
                           "OpenAI server with VLLM_SERVER_DEV_MODE=1?")
    return size


class WeightTransferSession:
    """The sending rank's side of one vLLM server's weight-transfer engine: the group is formed on the first
    `send` and kept for the next ones (module doc for the calls)."""

    def __init__(self, transport: HttpTransport, backend: TransferBackend, *, rendezvous_host: str):
        """rendezvous_host: the address the server reaches this rank at (gloo's store listens there)."""
        self.transport = transport
        self.backend = backend
        self.rendezvous_host = rendezvous_host
        self.group: BroadcastGroup | None = None
        self.world_size = 0
        self._poster = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-weight-transfer")

    @property
    def url(self) -> str:
        return self.transport.url

    def _post(self, endpoint: str, body: Any = None, *, summary: str = "") -> Any:
        return self.transport.post_json(endpoint, body, summary=summary or endpoint, retry=TRANSFER_RETRY)

    def _alongside(self, endpoint: str, body: Any, collective: Callable[[], None], *, summary: str) -> Any:
        """POST `body` while running `collective` here (the server answers once its side of the collective
        is done); when the collective fails and the server refused the request (it never joined), the server's
        error is raised: that is the cause."""
        answer: Future = self._poster.submit(self._post, endpoint, body, summary=summary)
        try:
            collective()
        except BaseException as err:
            try:
                refusal = answer.exception(timeout=REFUSAL_GRACE_S)
            except TimeoutError:  # the server is still inside its side: the collective's error is the cause
                refusal = None
            if refusal is not None:
                raise refusal from err
            raise
        return answer.result()

    def connect(self) -> None:
        """Form the group with the server's workers (once)."""
        if self.group is not None:
            return
        workers = _world_size(self.transport.get("/get_world_size", retry=TRANSFER_RETRY), self.url)
        world_size = 1 + workers
        group = self.backend.open_group(rendezvous_host=self.rendezvous_host, world_size=world_size)
        init_info = self.backend.init_info(group, world_size=world_size, rendezvous_host=self.rendezvous_host)
        self._alongside("/init_weight_transfer_engine", {"init_info": init_info}, group.join,
                        summary=f"join the {self.backend.name} weight-transfer group of {world_size} ranks")
        self.group, self.world_size = group, world_size

    def send(self, buckets: Iterable[WeightBucket], *, version: int) -> int:
        """One update: every bucket under one start/finish, then vLLM's weight version set to `version`.
        Returns the number of tensors sent."""
        self.connect()
        self._post("/start_weight_update", summary=f"start weight version {version}")
        sent = 0
        try:
            for bucket in buckets:
                refuse_non_finite(bucket, url=self.url, version=version)
                self._alongside("/update_weights", build_update_info(bucket),
                                lambda bucket=bucket: self._broadcast(bucket),
                                summary=f"{len(bucket)} tensors of weight version {version}")
                sent += len(bucket)
        except WeightTransferRefused:
            self._post("/finish_weight_update", summary="close the refused update")  # nothing of this bucket sent
            raise
        if sent == 0:
            self._post("/finish_weight_update", summary="close the empty update")
            raise ValueError("update_weights: no buckets given")
        self._post("/finish_weight_update", summary=f"finish weight version {version}")
        self._post("/update_weight_version", {"new_version": str(int(version))}, summary=f"weight version {version}")
        return sent

    def _broadcast(self, bucket: WeightBucket) -> None:
        for _, tensor in bucket:  # the server receives in `names` order
            self.group.broadcast(tensor)

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
        self._poster.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
