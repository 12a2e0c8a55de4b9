"""megatron's all-gather MoE token dispatcher for packed micro-batches whose token counts differ per rank.

The all-gather dispatcher (the one that runs on CPU over gloo) gathers every rank's tokens over the
TP x EP group with `all_gather_into_tensor` and hands each rank's tokens back with a reduce-scatter:
both need the same token count T on every rank. Stacx packs micro-batches by tokens, so the ranks of
an expert-parallel group (different DP ranks) hold micro-batches of different lengths T_r.

`UnevenAllGatherTokenDispatcher` pads each rank's tokens to T_max = max_r T_r before the gather, with
rows that route to no expert (routing map False, probability 0), and drops them after the
reduce-scatter:

    hidden [T_r, H] -> [T_max, H]  --all-gather-->  [T_max * tp * ep, H]  -> local experts
    experts' output [T_max * tp * ep, H]  --reduce-scatter-->  [T_max, H]  -> [T_r, H]

The padding rows are never processed by an expert (their output is zero and is dropped), and the
router ran before on the real tokens only, so outputs, router losses and expert-load counts are
those of the unpadded tokens. Cost: one all-reduce (MAX) of one integer per MoE layer and forward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def _max_over_group(value: int, group) -> int:
    count = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def _pad_rows(tensor_TX: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`tensor_TX` with zero (False) rows appended up to `num_rows` rows."""
    missing = num_rows - tensor_TX.shape[0]
    if missing == 0:
        return tensor_TX
    return torch.cat([tensor_TX, tensor_TX.new_zeros((missing, *tensor_TX.shape[1:]))])


@functools.cache
def uneven_allgather_dispatcher_class():
    """The subclass of megatron's `MoEAllGatherTokenDispatcher`, defined on first use."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class UnevenAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
        """All-gather dispatch of a different token count on each rank of the TP x EP group (see the module)."""

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            hidden_TH, probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
            self.num_local_tokens = hidden_TH.shape[0]
            num_rows = self.num_local_tokens
            if self.tp_size > 1 or self.ep_size > 1:
                num_rows = _max_over_group(num_rows, self.tp_ep_group)
            self.routing_map = _pad_rows(self.routing_map, num_rows)  # [T_max, E]: padding routes nowhere
            return _pad_rows(hidden_TH, num_rows), _pad_rows(probs, num_rows)

        def combine_postprocess(self, hidden_states):
            return hidden_states[: self.num_local_tokens].view(self.hidden_shape)

    return UnevenAllGatherTokenDispatcher


def use_uneven_allgather_dispatch(model) -> int:
    """Switch every all-gather token dispatcher in `model` to `UnevenAllGatherTokenDispatcher` (same state,
    same collectives plus one integer all-reduce); returns how many were switched."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    uneven = uneven_allgather_dispatcher_class()
    switched = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if type(dispatcher) is MoEAllGatherTokenDispatcher:
            dispatcher.__class__ = uneven
            switched += 1
    return switched
