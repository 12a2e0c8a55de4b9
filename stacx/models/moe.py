"""Mixture-of-experts hooks of a built model: the router losses' gradient scale and the expert load.

    set_router_loss_scale(reducer.router_loss_scale(micro_batch_tokens))  # before each backward
    with ExpertLoadRecorder(model) as load:                                 # forwards inside are counted
        ...
    metrics = expert_load_metrics(load.tokens_per_expert(groups))           # after the step

Router losses. megatron adds each MoE layer's load-balancing loss (--moe-aux-loss-coeff) and z-loss
(--moe-z-loss-coeff) to the backward of that layer's output, multiplied by one class-wide scale. Each
is a mean over the micro-batch's routed tokens (summed over the CP ranks that hold parts of it), so
Stacx sets that scale to the micro-batch's share of the step's routed tokens times the DDP
averaging factor (`Reducer.router_loss_scale`): the optimizer then sees the token-weighted mean of
the per-micro-batch router losses, as it sees the token-weighted main loss.

Expert load. A forward hook on each layer's router reads its routing map [tokens, experts] and counts
the tokens sent to each expert (not the padding megatron's padding_mask marks); `expert_load_metrics`
turns the counts, summed over the DP x CP ranks (and over TP under sequence parallelism, where each TP
rank routes its part of the sequence; otherwise TP ranks route the same tokens), into per-layer counts
and the max/mean imbalance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def set_router_loss_scale(scale: float) -> None:
    """Multiply the router losses' gradient of the next backwards by `scale` (megatron's class-wide scale)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale)))


def is_mixture_of_experts(gpt_model) -> bool:
    """Whether the (unwrapped) model has MoE layers."""
    return bool(getattr(gpt_model.config, "num_moe_experts", None))


def _routers(gpt_model) -> list[tuple[int, torch.nn.Module]]:
    """(layer number, router) of every MoE layer, in layer order."""
    routers = []
    for name, module in gpt_model.named_modules():
        if name.endswith(".mlp.router"):
            routers.append((int(name.split("decoder.layers.")[1].split(".")[0]), module))
    return routers


class ExpertLoadRecorder:
    """Counts the tokens each router sends to each expert, for the forwards run while it is entered."""

    def __init__(self, gpt_model):
        self._routers = _routers(gpt_model)
        num_experts = gpt_model.config.num_moe_experts or 0
        self._counts_LE = torch.zeros(len(self._routers), num_experts, dtype=torch.float64)
        self._sequence_parallel = bool(getattr(gpt_model.config, "sequence_parallel", False))
        self._handles = []

    def __enter__(self) -> "ExpertLoadRecorder":
        for index, (_layer, router) in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._counter(index), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _counter(self, index: int):
        def count(_module, inputs, kwargs, outputs):
            _probs, routing_map = outputs  # routing_map: [tokens, experts] bool
            # router(hidden_states, padding_mask): True = padding (sequence-parallel fill), [tokens] once flat
            padding = inputs[1] if len(inputs) > 1 else kwargs.get("padding_mask")
            if padding is not None:
                routing_map = routing_map & ~padding.reshape(-1, 1)
            self._counts_LE[index] += routing_map.detach().sum(dim=0).to("cpu", torch.float64)
        return count

    def tokens_per_expert(self, groups) -> torch.Tensor:
        """[layers, experts] token slots routed to each expert, summed over the DP x CP (x TP under sequence
        parallelism) ranks (collective)."""
        counts = self._counts_LE.clone()
        if groups.dp_cp is not None and groups.dp_cp_size > 1:
            dist.all_reduce(counts, group=groups.dp_cp)
        if self._sequence_parallel and groups.tp_size > 1:
            dist.all_reduce(counts, group=groups.tp)
        return counts

    @property
    def layers(self) -> list[int]:
        return [layer for layer, _ in self._routers]


def expert_load_metrics(tokens_per_expert_LE: torch.Tensor, layers: list[int] | None = None) -> dict[str, float]:
    """Per layer: `moe/layer{i}/expert{e}_tokens` and `moe/layer{i}/imbalance` = max_e / mean_e tokens
    (1.0 is perfectly balanced, num_experts is every token on one expert); `moe/max_imbalance` over layers."""
    layers = list(range(tokens_per_expert_LE.shape[0])) if layers is None else layers
    metrics: dict[str, float] = {}
    worst = 0.0
    for layer, counts in zip(layers, tokens_per_expert_LE):
        mean = counts.mean().item()
        imbalance = counts.max().item() / mean if mean > 0 else 0.0
        worst = max(worst, imbalance)
        metrics[f"moe/layer{layer}/imbalance"] = imbalance
        metrics.update({f"moe/layer{layer}/expert{e}_tokens": float(c) for e, c in enumerate(counts.tolist())})
    if layers:
        metrics["moe/max_imbalance"] = worst
    return metrics
