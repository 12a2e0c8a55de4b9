"""Mixture-of-experts hooks of a built model: the router losses' gradient scale and the expert load.

    loss = scale_router_losses_in_backward(loss, reducer.router_loss_scale(micro_batch_tokens))
    # or, with no schedule between forward and backward:
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

Under a pipeline schedule a stage runs other micro-batches' forwards between one micro-batch's forward
and its backward (and megatron resets the scale in each forward), so the scale is set by the backward
itself: `scale_router_losses_in_backward` hooks the tensor each stage's backward starts from (the loss
on the last stage, the hidden states sent on elsewhere), which runs before any of the stage's layers.

Expert load. A forward hook on each layer's router reads its routing map [tokens, experts] and counts
the tokens sent to each expert (not the padding megatron's padding_mask marks); `expert_load_metrics`
turns the counts, summed over the DP x CP ranks (and over TP under sequence parallelism, where each TP
rank routes its part of the sequence; otherwise TP ranks route the same tokens), into per-layer counts
and the max/mean imbalance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stacx.models.builder import model_chunks
from stacx.models.weight_mapping import layer_offset
from stacx.parallel.groups import ProcessGroups


def set_router_loss_scale(scale: float) -> None:
    """Multiply the router losses' gradient of the next backwards by `scale` (megatron's class-wide scale)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # Shape [1], as megatron's schedules set it (they copy into the tensor set first).
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([float(scale)]))


def scale_router_losses_in_backward(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """`tensor`, unchanged, with a hook that sets the router losses' scale to `scale` when the backward
    reaches it: hook the tensor a stage's backward starts from (see the module docstring)."""
    if tensor.requires_grad:
        tensor.register_hook(lambda grad: set_router_loss_scale(scale))
    return tensor


def is_mixture_of_experts(gpt_model) -> bool:
    """Whether the (unwrapped) model, or list of model chunks, has MoE layers."""
    return bool(getattr(model_chunks(gpt_model)[0].config, "num_moe_experts", None))


def routers_by_layer(gpt_model) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every MoE layer of this pipeline stage (all its chunks), in layer order."""
    routers = []
    for chunk in model_chunks(gpt_model):
        offset = layer_offset(chunk)
        for name, module in chunk.named_modules():
            if name.endswith(".mlp.router"):
                routers.append((offset + int(name.split("decoder.layers.")[1].split(".")[0]), module))
    return routers


class RouterHooks:
    """A forward hook on every MoE router of a model (all its chunks) while entered.

    A subclass says what each hook does: `_hook(index, layer)` returns the hook of `self._routers[index]`,
    the router of global layer `layer`; it receives megatron's router outputs (probs, routing_map
    [tokens, experts] bool)."""

    def __init__(self, gpt_model):
        self._routers = routers_by_layer(gpt_model)
        self._handles = []

    def __enter__(self):
        for index, (layer, router) in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(index, layer), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int, layer: int):
        """The forward hook (module, args, kwargs, outputs) of router `index` (global layer `layer`)."""
        raise NotImplementedError


class ExpertLoadRecorder(RouterHooks):
    """Counts the tokens each router sends to each expert, for the forwards run while it is entered."""

    def __init__(self, gpt_model):
        super().__init__(gpt_model)
        config = model_chunks(gpt_model)[0].config
        self._counts_LE = torch.zeros(len(self._routers), config.num_moe_experts or 0, dtype=torch.float64)
        self._dropped_L = torch.zeros(len(self._routers), dtype=torch.float64)
        self._top_k = int(getattr(config, "moe_router_topk", 1) or 1)
        self._sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def _hook(self, index: int, layer: int):
        def count(_module, inputs, kwargs, outputs):
            _probs, routing_map = outputs  # routing_map: [tokens, experts] bool
            # router(hidden_states, padding_mask): True = padding (sequence-parallel fill), [tokens] once flat
            padding = inputs[1] if len(inputs) > 1 else kwargs.get("padding_mask")
            tokens = routing_map.shape[0]
            if padding is not None:
                routing_map = routing_map & ~padding.reshape(-1, 1)
                tokens -= int(padding.sum())
            routed = routing_map.detach().sum(dim=0).to("cpu", torch.float64)
            self._counts_LE[index] += routed
            # Each token offers top-k slots; a capacity factor drops the ones over an expert's capacity
            # (padding to capacity adds slots: never counted as negative drops).
            self._dropped_L[index] += max(0.0, self._top_k * tokens - float(routed.sum()))
        return count

    def tokens_per_expert(self, groups: ProcessGroups) -> torch.Tensor:
        """[layers, experts] token slots routed to each expert, summed over the DP x CP (x TP under sequence
        parallelism) ranks (collective)."""
        return self._summed_over_token_ranks(self._counts_LE, groups)

    def dropped_token_slots(self, groups: ProcessGroups) -> torch.Tensor:
        """[layers] token slots the routers dropped, summed as `tokens_per_expert` sums (collective)."""
        return self._summed_over_token_ranks(self._dropped_L, groups)

    def _summed_over_token_ranks(self, local: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
        """`local` (this rank's counts) summed over the ranks that hold other tokens: DP x CP, and TP under
        sequence parallelism (collective)."""
        total = local.clone()
        if groups.dp_cp is not None and groups.dp_cp_size > 1:
            dist.all_reduce(total, group=groups.dp_cp)
        if self._sequence_parallel and groups.tp_size > 1:
            dist.all_reduce(total, group=groups.tp)
        return total

    @property
    def layers(self) -> list[int]:
        return [layer for layer, _ in self._routers]


def expert_load_metrics(tokens_per_expert_LE: torch.Tensor, layers: list[int] | None = None,
                        dropped_token_slots_L: torch.Tensor | None = None) -> dict[str, float]:
    """Per layer: `moe/layer{i}/expert{e}_tokens` and `moe/layer{i}/imbalance` = max_e / mean_e tokens
    (1.0 is perfectly balanced, num_experts is every token on one expert); over layers: `moe/max_imbalance`
    and `moe/mean_imbalance`, and `moe/dropped_tokens` (token slots a capacity factor dropped) when
    `dropped_token_slots_L` has any. The driver logs the summary only, unless --log-expert-load per-expert
    (stacx.trainer.expert_load_plot)."""
    layers = list(range(tokens_per_expert_LE.shape[0])) if layers is None else layers
    metrics: dict[str, float] = {}
    imbalances = []
    for layer, counts in zip(layers, tokens_per_expert_LE):
        mean = counts.mean().item()
        imbalance = counts.max().item() / mean if mean > 0 else 0.0
        imbalances.append(imbalance)
        metrics[f"moe/layer{layer}/imbalance"] = imbalance
        metrics.update({f"moe/layer{layer}/expert{e}_tokens": float(c) for e, c in enumerate(counts.tolist())})
    if layers:
        metrics["moe/max_imbalance"] = max(imbalances)
        metrics["moe/mean_imbalance"] = sum(imbalances) / len(imbalances)
    if dropped_token_slots_L is not None and float(dropped_token_slots_L.sum()) > 0:
        metrics["moe/dropped_tokens"] = float(dropped_token_slots_L.sum())
    return metrics
