"""vLLM's weight-transfer API over gloo: the `stacx_gloo` backend of a vLLM server's workers.

vLLM 0.32 ships NCCL, IPC and sparse weight-transfer engines, all for GPUs. This engine takes the same
messages as its NCCL engine (`/init_weight_transfer_engine` with `master_address`, `master_port`,
`rank_offset`, `world_size`; `/update_weights` with `names`, `dtype_names`, `shapes`; layerwise reload
between `/start_weight_update` and `/finish_weight_update`) and receives each tensor by a gloo broadcast
from the trainer (rank 0), which hosts the group's store. A server takes it with
`--weight-transfer-config '{"backend": "stacx_gloo"}'`; Stacx's trainer sends with `--vllm-weight-transfer
gloo` (stacx.rollout.engines.vllm_weight_transfer). It is what runs the trainer's side of vLLM's weight-transfer
API on a CPU, where NCCL cannot.

The worker extension (stacx_vllm_worker) registers it when vLLM imports the extension, before the worker
builds its engine. Imports vLLM and torch only.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND = "stacx_gloo"
GROUP_TIMEOUT_S = 600.0


def gloo_engine_class():
    """The engine class (defined on first use: it subclasses vLLM's NCCL engine, which needs vLLM)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):
        """vLLM's dense NCCL engine with a gloo group in place of its NCCL communicator (unpacked transfers)."""

        def init_transfer_engine(self, init_info) -> None:
            if init_info.master_address is None or init_info.master_port is None:
                raise ValueError(f"{BACKEND}: init_info needs master_address and master_port (the trainer's store)")
            if init_info.packed:
                raise ValueError(f"{BACKEND}: packed transfers are not supported; send packed=false")
            parallel = self.parallel_config
            rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
            store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                                  is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
            self.model_update_group = dist.ProcessGroupGloo(store, rank, init_info.world_size,
                                                            timedelta(seconds=GROUP_TIMEOUT_S))
            self.packed = False

        def receive_weights(self, update_info) -> None:
            if self.model_update_group is None:
                raise RuntimeError(f"{BACKEND}: /init_weight_transfer_engine first")
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            options = dist.BroadcastOptions()
            options.rootRank = 0
            with disable_mtp_completeness_check():
                for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                    dtype = getattr(torch, str(dtype_name), None)
                    if not isinstance(dtype, torch.dtype):
                        raise ValueError(f"{BACKEND}: tensor {name!r} has dtype {dtype_name!r}, not a torch dtype")
                    weight = torch.empty(shape, dtype=dtype)
                    self.model_update_group.broadcast([weight], options).wait()
                    self.model.load_weights([(name, weight)])

        def shutdown(self) -> None:
            self.model_update_group = None

    return GlooWeightTransferEngine


def register() -> None:
    """Offer `stacx_gloo` to vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, gloo_engine_class())
