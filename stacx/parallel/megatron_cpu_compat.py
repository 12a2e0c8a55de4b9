"""Lets megatron-core's GPT model, tensor-parallel layers, DDP and optimizer run on CPU over gloo.

megatron-core assumes CUDA in a handful of places that have nothing to do with the math:
buffers are allocated on `torch.cuda.current_device()`, the RNG tracker saves CUDA generator
states, and the optimizer builder asks for CUDA-only fused kernels. On a machine without CUDA
Stacx applies the patches below, once, before any model is built. Each is a no-op when CUDA is
present: `apply_if_needed()` returns without touching anything then.

Patches (each covered by tests/parallel/test_megatron_cpu_compat.py):

1. `torch.cuda.current_device()` -> the CPU device. Used for allocation targets in
   tensor-parallel mappings (all-gather outputs), rotary embeddings (`inv_freq`) and the global
   memory buffer. On a CPU-only build the original raises, so nothing that works is changed.
2. `torch` as seen by three megatron modules -> a view of torch whose tensor factories map
   `device="cuda"` to the CPU. `megatron.core.optimizer.optimizer` (loss-scale and found-inf
   scalars), `megatron.core.optimizer.clip_grads` (grad-norm buffers) and `megatron.core.utils`
   (the local multi-tensor l2-norm fallback) allocate with a literal `device='cuda'`. The view
   is installed in those modules' namespaces only, so `get_megatron_optimizer` builds, clips
   and steps on CPU and no other code sees it.
3. `clip_grad_by_total_norm_fp32` -> the same scaling without its assertion that gradients
   are `torch.cuda.FloatTensor`. Installed where the optimizer looks it up.
4. `get_pos_emb_on_this_cp_rank` -> the same index_select of chunks r and 2*cp-1-r, without the
   pinned-memory index tensor and `.cuda()` copy (used by RoPE under CP for unpacked batches).
5. `torch.cuda.synchronize()` -> a no-op. megatron's torch_dist checkpoint writer
   (`FileSystemWriterAsync.preload_tensors`) waits for device copies before writing; on CPU
   there is nothing to wait for, and on a CPU-only build the original raises.
6. Pipeline parallelism: the schedule module's `torch` gets the view of patch 2 (it counts
   tokens in a `device="cuda"` tensor), and `LanguageModule.setup_embeddings_and_output_layer`
   runs with `Tensor.cuda` as the identity: with tied embeddings it moves the last stage's copy
   of the embedding to the GPU before the all-reduce that makes it equal the first stage's.
7. `megatron.core.transformer.moe.moe_utils.te_general_gemm` -> None when transformer-engine is
   absent. The MoE router's gating linear (`RouterGatingLinearFunction`) reads that name, which
   the module defines only when its transformer-engine import succeeds; None selects its plain
   torch matmul, as the module intends.
8. `CudaRNGStatesTracker.fork` for a state that was never added (on CPU none is: megatron seeds them
   on CUDA) -> the body runs under `torch.random.fork_rng(devices=[])`, so the CPU generator is
   restored after it, as the original restores the CUDA one. Under sequence parallelism the
   embedding forks the model-parallel state around its dropout (Stacx runs dropout 0, so nothing
   draws from it).
9. Pipeline point-to-point exchanges over gloo (`_batched_p2p_ops`, and the shape exchange before it,
   `P2PCommunicator._communicate_shapes`) -> the same operations, changed in two ways that megatron's
   interleaved schedule (virtual pipeline stages) needs:
   - a tag per direction. megatron posts send-to-previous, receive-from-previous, send-to-next and
     receive-from-next with one tag, and a receive takes the first message from its peer; when the previous
     and the next stage are one rank (P=2) and both directions carry a tensor in one exchange, the
     activation lands in the gradient's buffer and the other way round. Sends to the next stage and
     receives from the previous one get a forward tag, the other two a backward tag (shapes their own pair).
   - sends complete in the background. The schedule waits for every request of an exchange before the
     next, and sometimes sends in one exchange what its neighbour receives only in a later one: NCCL
     completes such a small send eagerly, a gloo send waits for its receive, and the ranks wait for each
     other in a cycle (P=4). An exchange now waits for its receives only; its sends (holding their
     tensors) are waited for by `finish_pipeline_sends()` after the schedule (`stacx.parallel.pipeline`).
   Groups of another backend get the originals.

Five CPU adaptations live outside this module, where the code they adapt is chosen (no patch of
megatron's own code is needed for them):

- `stacx.parallel.groups.default_backend`: gloo process groups instead of NCCL;
- `stacx.models.builder._layer_spec` (and `transformer_engine_available`): megatron's local layer spec
  with Stacx's own core attention (`stacx.models.packed_attention.PackedCoreAttention`) instead of
  transformer-engine's;
- `stacx.models.builder.build_transformer_config`: CPU initialization, kernel fusions off, and the
  all-gather MoE token dispatcher (all-to-all needs CUDA streams), made uneven-capable by
  `stacx.parallel.moe_dispatch.use_uneven_allgather_dispatch`;
- `stacx.parallel.pipeline`: `finish_pipeline_sends()` after each schedule (the other half of patch 9);
- `stacx.trainer.runtime.optim.use_fused_adamw_on_cpu`: torch's fused Adam/AdamW kernel for CPU
  parameter groups, which megatron leaves on the per-parameter loop.

tests/parallel/test_megatron_cpu_compat.py checks that this list and docs/architecture.md count the
patches `apply_if_needed` applies.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import contextmanager

import torch

_applied = False


def cuda_is_present() -> bool:
    return torch.cuda.is_available()


def apply_if_needed() -> bool:
    """Apply every patch when CUDA is absent. Returns True if patches are (now) active."""
    global _applied
    if cuda_is_present():
        return False
    if _applied:
        return True
    _patch_current_device()
    _patch_optimizer_tensor_factories()
    _patch_grad_clipping()
    _patch_cp_rope_slicing()
    _patch_synchronize()
    _patch_tied_embedding_setup()
    _patch_moe_router_gemm()
    _patch_rng_tracker_fork()
    _patch_pipeline_exchange_tags()
    _applied = True
    return True


def is_applied() -> bool:
    return _applied


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _patch_current_device() -> None:
    torch.cuda.current_device = _cpu_current_device


class _CpuTensorFactories:
    """Forwards every attribute to `torch`, except factories that are told `device="cuda"`."""

    _FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in self._FACTORIES:
            return functools.partial(_on_cpu, value)
        return value


def _on_cpu(factory, *args, **kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs["device"] = "cpu"
    return factory(*args, **kwargs)


MODULES_ALLOCATING_ON_CUDA = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
)


def _patch_optimizer_tensor_factories() -> None:
    for module_name in MODULES_ALLOCATING_ON_CUDA:
        importlib.import_module(module_name).torch = _CpuTensorFactories()


def clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's `clip_grad_by_total_norm_fp32` for CPU fp32 gradients (scales grads in place)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_([g.detach() for g in grads], clip_coeff)


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads as mcore_clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    mcore_clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu


def get_pos_emb_on_this_cp_rank_cpu(pos_emb, seq_dim, cp_group):
    """Rotary table rows of this CP rank's two load-balanced chunks (r and 2*cp-1-r)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunk_ids = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, chunk_ids)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _patch_cp_rope_slicing() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank_cpu
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank_cpu


def _synchronize_nothing(device=None) -> None:
    """CPU work is synchronous: nothing is queued on a device, so there is nothing to wait for."""


def _patch_synchronize() -> None:
    torch.cuda.synchronize = _synchronize_nothing


def _run_with_tensor_cuda_as_identity(method):
    @functools.wraps(method)
    def on_cpu(*args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = _tensor_stays_on_cpu
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    on_cpu.stacx_cpu_stand_in = True
    return on_cpu


def _tensor_stays_on_cpu(tensor, *args, **kwargs):
    return tensor


def _patch_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    method = LanguageModule.setup_embeddings_and_output_layer
    if not getattr(method, "stacx_cpu_stand_in", False):
        LanguageModule.setup_embeddings_and_output_layer = _run_with_tensor_cuda_as_identity(method)


def _patch_moe_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_rng_tracker_fork() -> None:
    # Imported here, as in the other patches: megatron-core is imported only when the patches apply.
    from megatron.core.tensor_parallel import random as megatron_random

    tracker_class = megatron_random.CudaRNGStatesTracker
    original = tracker_class.fork

    @contextmanager
    def fork_on_cpu(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name in self.states_:
            with original(self, name):
                yield
            return
        with torch.random.fork_rng(devices=[]):
            yield

    tracker_class.fork = fork_on_cpu




#: Tags of patch 9: a message travelling to the next stage (activations, their shapes) and to the previous one
#: (gradients). The shapes get tags of their own so that a shape never meets a tensor's receive.
FORWARD_TAG, BACKWARD_TAG, FORWARD_SHAPE_TAG, BACKWARD_SHAPE_TAG = 1, 2, 3, 4

#: Patch 9's sends not yet waited for, with the tensors they read (kept alive until they complete).
_sends_in_flight: list[tuple[object, torch.Tensor]] = []


def post_tagged_exchange(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                         prev_pipeline_rank, next_pipeline_rank, forward_tag=FORWARD_TAG, backward_tag=BACKWARD_TAG):
    """megatron's `_batched_p2p_ops` with a tag per direction, returning the receives' requests only: the
    sends complete in the background until `finish_pipeline_sends()` (patch 9)."""
    dist = torch.distributed
    # detach(): megatron may free a sent activation's storage (`deallocate_pipeline_outputs`) before the send
    # completes; the detached tensor keeps it.
    sends = [(tensor.detach(), peer, tag) for tensor, peer, tag in ((tensor_send_prev, prev_pipeline_rank, backward_tag),
                                                                   (tensor_send_next, next_pipeline_rank, forward_tag))
             if tensor is not None]
    receives = [(tensor, peer, tag) for tensor, peer, tag in ((tensor_recv_prev, prev_pipeline_rank, forward_tag),
                                                              (tensor_recv_next, next_pipeline_rank, backward_tag))
                if tensor is not None]
    ops = ([dist.P2POp(dist.isend, tensor, peer, group, tag) for tensor, peer, tag in sends]
           + [dist.P2POp(dist.irecv, tensor, peer, group, tag) for tensor, peer, tag in receives])
    requests = dist.batch_isend_irecv(ops) if ops else []
    _sends_in_flight.extend(zip(requests[:len(sends)], (tensor for tensor, _, _ in sends)))
    return requests[len(sends):]


def finish_pipeline_sends() -> None:
    """Wait for every send patch 9 left in flight (after a pipeline schedule; a no-op when there is none)."""
    while _sends_in_flight:
        request, _ = _sends_in_flight.pop(0)
        request.wait()


def _patch_pipeline_exchange_tags() -> None:
    from megatron.core.pipeline_parallel import p2p_communication

    if getattr(p2p_communication._batched_p2p_ops, "stacx_cpu_stand_in", False):
        return
    original_exchange = p2p_communication._batched_p2p_ops
    original_shapes = p2p_communication.P2PCommunicator._communicate_shapes

    def batched_exchange(*, group, **tensors_and_peers):
        if torch.distributed.get_backend(group) != "gloo":
            return original_exchange(group=group, **tensors_and_peers)
        return post_tagged_exchange(group=group, **tensors_and_peers)

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.config.use_ring_exchange_p2p or torch.distributed.get_backend(self.pp_group) != "gloo":
            return original_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)

        def shape_of(tensor):
            return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

        recv_prev_shape = torch.empty((3,), dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty((3,), dtype=torch.int64) if recv_next else None
        for request in post_tagged_exchange(
                tensor_send_prev=shape_of(tensor_send_prev), tensor_recv_prev=recv_prev_shape,
                tensor_send_next=shape_of(tensor_send_next), tensor_recv_next=recv_next_shape, group=self.pp_group,
                prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank,
                forward_tag=FORWARD_SHAPE_TAG, backward_tag=BACKWARD_SHAPE_TAG):
            request.wait()
        return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
                [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())

    batched_exchange.stacx_cpu_stand_in = True
    p2p_communication._batched_p2p_ops = batched_exchange
    p2p_communication.P2PCommunicator._communicate_shapes = communicate_shapes
