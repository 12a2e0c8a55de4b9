"""The trainer's end of a weight-broadcast group an inference server's ranks join (rank 0 sends).

Two ways to form one, both standalone groups outside the trainer's own world:

- `WeightBroadcastGroup`: a torch.distributed group (NCCL on GPU, gloo on CPU) over a TCPStore the
  trainer hosts on one address (`host_bound_store`): SGLang's `/init_weights_update_group`, and vLLM's
  weight-transfer API over gloo (`stacx.rollout.engines.vllm_weight_transfer`).
- `NcclUniqueIdGroup`: an NCCL communicator from an `ncclUniqueId` the trainer mints and ships to the
  server (vLLM's `nccl_unique_id_b64` rendezvous: no store, every rank enters at once, then the one-element
  fp32 all-reduce vLLM's communicator issues as its warm-up handshake). Built on torch's own NCCL binding
  (`torch.cuda.nccl`), so the trainer needs no vLLM installed.

    group = WeightBroadcastGroup.hosted(master_address="10.0.0.5", world_size=3, backend="gloo")
    ... the server joins at group.master_port as ranks 1 and 2 (in another thread: joining blocks) ...
    group.join()
    group.broadcast(tensor)          # every receiver gets tensor's bytes, in the order sent
"""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from stacx.parallel.bound_store import host_bound_store

NCCL_UNIQUE_ID_BYTES = 128
"""Size of an `ncclUniqueId` (what vLLM checks the decoded `nccl_unique_id_b64` against)."""
BACKENDS = ("nccl", "gloo")


class WeightBroadcastGroup:
    """Rank `rank` (0: the sender) of a torch.distributed group over its own TCPStore, outside the trainer's
    default world: NCCL on GPU, gloo on CPU.

    `WeightBroadcastGroup(master_address=..., master_port=..., world_size=...)` hosts the store (rank 0) or
    joins it and forms the group at once (both block until every rank joined). `hosted(...)` splits the two:
    the store first (on a free port when none is given, so its port can be sent to the other ranks), the group
    with `join()`.
    """

    def __init__(self, *, master_address: str, master_port: int, world_size: int, rank: int = 0,
                 backend: str = "nccl", timeout_s: float = 600.0, store: Optional[dist.TCPStore] = None,
                 join: bool = True):
        """store: the group's store when the caller hosts it already (`hosted`); None: hosted here (rank 0)
        or joined (other ranks). join: form the group now (else `join()` does)."""
        if backend not in BACKENDS:
            raise ValueError(f"weight update backend must be one of {BACKENDS}, got {backend!r}")
        if store is None:
            store = self._store(master_address, master_port, world_size, rank, timeout_s)
        self.store = store
        self.master_address, self.master_port = master_address, master_port
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout_s = timeout_s
        self.group = None
        if join:
            self.join()

    @classmethod
    def hosted(cls, *, master_address: str, world_size: int, backend: str = "gloo", master_port: int = 0,
               timeout_s: float = 600.0) -> "WeightBroadcastGroup":
        """Rank 0's store on `master_address` (port 0: a free one, read back as `master_port`); the group is
        formed by `join()`, once the other ranks were told where to join."""
        store, port = host_bound_store(master_address, timeout_s, port=master_port, world_size=world_size,
                                       purpose="weight-update group")
        return cls(master_address=master_address, master_port=port, world_size=world_size, rank=0, backend=backend,
                   timeout_s=timeout_s, store=store, join=False)

    @staticmethod
    def _store(master_address: str, master_port: int, world_size: int, rank: int, timeout_s: float) -> dist.TCPStore:
        if rank == 0:  # the trainer hosts the group's store on the address the server's ranks were given, only there
            store, _ = host_bound_store(master_address, timeout_s, port=master_port, world_size=world_size,
                                        purpose="weight-update group")
            return store
        return dist.TCPStore(master_address, master_port, world_size, is_master=False,
                             timeout=timedelta(seconds=timeout_s))

    def join(self) -> None:
        """Form the group (blocks until every rank has joined)."""
        if self.group is not None:
            return
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, self.rank, self.world_size,
                                               timedelta(seconds=self.timeout_s))
        else:
            self.group = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send (rank 0: a gloo group sends a CPU copy of a device tensor) or receive `tensor` in place."""
        if self.group is None:
            raise RuntimeError("WeightBroadcastGroup.broadcast before join()")
        if self.rank == 0:
            tensor = (tensor.detach().cpu() if self.backend == "gloo" else tensor).contiguous()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        self.group = None


def require_cuda(what: str) -> torch.device:
    """The current CUDA device; RuntimeError naming `what` (the flag that asked for NCCL) without one."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what}: NCCL needs a CUDA device on the sending trainer rank, and this one has none "
                           "(CPU torch, or no GPU visible)")
    if not hasattr(torch._C, "_nccl_init_rank"):
        raise RuntimeError(f"{what}: this torch build has no NCCL")
    return torch.device("cuda", torch.cuda.current_device())


class NcclUniqueIdGroup:
    """Rank 0 (the sender) of an NCCL communicator of `world_size` ranks formed from a unique id it mints:
    `unique_id_b64` goes to the other ranks (standard base64 of the 128 bytes), then `join()` with them at once."""

    def __init__(self, *, world_size: int, what: str = "NCCL weight transfer"):
        """what: the flag or setting that asked for NCCL, named when this rank has no CUDA device."""
        self.device = require_cuda(what)
        self._unique_id: bytes = torch.cuda.nccl.unique_id()
        if len(self._unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise RuntimeError(f"torch minted an NCCL unique id of {len(self._unique_id)} bytes, not "
                               f"{NCCL_UNIQUE_ID_BYTES}")
        self._comm = None
        self.world_size = world_size

    @property
    def unique_id_b64(self) -> str:
        return base64.b64encode(self._unique_id).decode("ascii")

    def join(self) -> None:
        """Form the communicator as rank 0 (blocks until every rank entered), then the warm-up: one fp32 element
        all-reduced, which every vLLM rank issues right after joining."""
        if self._comm is not None:
            return
        with torch.cuda.device(self.device):
            self._comm = torch.cuda.nccl.init_rank(self.world_size, self._unique_id, 0)
            warm_up = torch.zeros(1, dtype=torch.float32, device=self.device)
            torch.cuda.nccl.all_reduce([warm_up], comms=[self._comm])
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send `tensor` from this rank (root 0) to every other rank; it goes to this rank's device first."""
        if self._comm is None:
            raise RuntimeError("NcclUniqueIdGroup.broadcast before join()")
        send = tensor.to(self.device, non_blocking=True).contiguous()
        torch.cuda.nccl.broadcast([send], root=0, comms=[self._comm])
        torch.cuda.current_stream(self.device).synchronize()  # `send` may be a temporary copy

    def close(self) -> None:
        self._comm = None  # torch's handle destroys the communicator when released
