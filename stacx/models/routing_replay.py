"""Routing replay (R3): record the experts a mixture-of-experts model routes each token to, and make
a later forward use those experts instead of routing again.

    with RoutesRecorder(gpt_model) as recorder:          # the CPU engine's packed decoding
        gpt_model(...)
    routes_TLK = recorder.routes()                        # [tokens, moe layers, top_k] int32

    with routes_replayed(gpt_model, routes_TLK):          # the trainer's policy forward
        gpt_model(...)                                    # same tokens, in the same order

Replay uses megatron-core's own mechanism (`megatron.core.transformer.moe.router_replay`): each
router's `RouterReplay` in `REPLAY_FORWARD` takes the given top-k indices and gathers the router's
scores at them (Stacx's subclass lets the tokens no engine ran route themselves), so the gates of the replayed experts are still computed from this model's router
logits (softmax over the k replayed logits for Qwen3-MoE's normalized top-k) and the router weights
get their gradient. Only the choice of experts is fixed. The load-balancing loss and z-loss keep
reading the model's own scores. Stacx attaches one `RouterReplay` per router of the model it is
given and keeps it off megatron's process-wide list, so two models in one process never share
routes.

A route row holds the k expert ids a token went to in one layer, in ascending order (the order
does not matter to the MoE layer: gates are scattered by expert id). Layers are the model's MoE
layers in order (every decoder layer, for the families in stacx.models.architectures), found by
each router's global `layer_number`, so a pipeline stage picks its own layers.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from stacx.models.moe import RouterHooks, routers_by_layer

#: dtype of route tensors everywhere (SGLang's wire format is int32 too).
ROUTE_DTYPE = torch.int32


def route_shape(gpt_model) -> tuple[int, int]:
    """(MoE layers of the whole model, top_k) of one token's route; raises for a dense model."""
    config = gpt_model.config
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("routing replay needs a mixture-of-experts model; this one is dense "
                         "(drop --use-routing-replay)")
    return int(config.num_layers), int(config.moe_router_topk)


def _unwrapped(model):
    # Imported here: megatron-core is slow to import (start-up time) and builder imports it.
    from stacx.models.builder import unwrap_model

    return unwrap_model(model)


def _tokens_of_this_rank(routes_TLK: torch.Tensor, config, tp_rank: int, tp_size: int) -> torch.Tensor:
    """With sequence parallelism each TP rank's routers see a contiguous 1/tp of the tokens."""
    if getattr(config, "sequence_parallel", False) and tp_size > 1:
        if routes_TLK.shape[0] % tp_size:
            raise ValueError(f"routing replay: {routes_TLK.shape[0]} tokens do not split over {tp_size} "
                             "sequence-parallel ranks")
        return routes_TLK.chunk(tp_size)[tp_rank]
    return routes_TLK


@functools.cache
def _replay_where_routed_class():
    """The class, built once on first use. Imported here: megatron-core is slow to import (start-up time)."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class ReplayWhereRouted(RouterReplay):
        """megatron's `RouterReplay` whose REPLAY_FORWARD lets rows of -1 (tokens no engine ran) route
        themselves: own top-k where the target row is -1, the target elsewhere, and the router's scores
        gathered at the chosen experts (as megatron's replay does)."""

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            _, own_TK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target_TK = self.target_topk_idx.to(scores.device)
            if target_TK.shape != own_TK.shape:
                raise ValueError(f"routing replay: {target_TK.shape[0]} routes for the {own_TK.shape[0]} tokens "
                                 "this router sees")
            chosen_TK = torch.where(target_TK < 0, own_TK, target_TK)
            return scores.gather(1, chosen_TK), chosen_TK

    return ReplayWhereRouted


class RoutesRecorder(RouterHooks):
    """Records the top-k experts of every router for the forwards run while it is entered.

    `routes()` concatenates the tokens of every recorded forward: [sum tokens, layers, top_k].
    """

    def __init__(self, model):
        gpt_model = _unwrapped(model)
        super().__init__(gpt_model)
        self._num_layers, self._top_k = route_shape(gpt_model)
        self._per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer, _ in self._routers}

    def _hook(self, index: int, layer: int):
        top_k = self._top_k

        def record(_module, _inputs, _kwargs, outputs):
            _probs, routing_map_TE = outputs  # [tokens, experts] bool, k True per row
            experts = routing_map_TE.nonzero()[:, 1]  # row-major: each row's experts ascending
            self._per_layer[layer].append(experts.view(-1, top_k).to("cpu", ROUTE_DTYPE))
        return record

    def routes(self) -> torch.Tensor:
        """[tokens, layers, top_k] int32 of the recorded forwards (layers this model holds)."""
        per_layer = [torch.cat(self._per_layer[layer]) for layer, _ in self._routers]
        return torch.stack(per_layer, dim=1)


@contextmanager
def routes_replayed(model, routes_TLK: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1) -> Iterator[None]:
    """The forwards inside route each token to the experts `routes_TLK` names.

    routes_TLK: [T, layers, top_k] (or SGLang's flat [T, layers * top_k]) integer expert ids, one row
    per token the model's forward sees, in the order it sees them (this CP rank's slice of the packed
    row, its padding included), for every MoE layer of the WHOLE model (a pipeline stage reads its own
    layers). A token whose row is -1 (padding, a sequence's last token: no engine ran it) routes
    itself, so replaying a model's own routes changes nothing, bitwise (its output reaches no log-prob,
    but the load-balancing loss's gradient flows through every token's gates).
    """
    gpt_model = _unwrapped(model)
    num_layers, top_k = route_shape(gpt_model)
    if routes_TLK.dim() == 2 and routes_TLK.shape[1] == num_layers * top_k:
        routes_TLK = routes_TLK.view(-1, num_layers, top_k)
    if routes_TLK.dim() != 3 or routes_TLK.shape[1:] != (num_layers, top_k):
        raise ValueError(f"routed experts must be [tokens, {num_layers} MoE layers, top_k={top_k}], "
                         f"got {tuple(routes_TLK.shape)}; the rollout engine served another model")
    num_experts = int(gpt_model.config.num_moe_experts)
    routed = routes_TLK[(routes_TLK >= 0).all(-1).all(-1)]
    if routed.numel() and int(routed.max()) >= num_experts:
        raise ValueError(f"routed experts hold ids outside [0, {num_experts}): the rollout engine served another model")
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    routes_TLK = _tokens_of_this_rank(routes_TLK, gpt_model.config, tp_rank, tp_size).long()
    routers = routers_by_layer(gpt_model)
    replay_class = _replay_where_routed_class()
    for layer, router in routers:
        if not isinstance(router.router_replay, replay_class):
            router.router_replay = replay_class()
            # Off megatron's process-wide list: this model's routers are driven through their own instances.
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
        router.router_replay.set_target_indices(routes_TLK[:, layer].contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _layer, router in routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

