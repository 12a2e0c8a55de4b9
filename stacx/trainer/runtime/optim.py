"""megatron-core DDP, optimizer and LR scheduler for one trainable role, from the run's `optim` section.

    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, optim_section, total_steps=num_optimizer_steps(train))

DDP: gradients accumulate in fp32 buffers over a step's micro-batches and are all-reduced over
DP x CP once, in `finish_grad_sync` (no overlap: the step's micro-batches run back to back and a
single sync keeps the number of collectives independent of the micro-batch count). megatron scales
the summed gradients by 1 / (dp * cp); the reducer's `gradient_scale` undoes exactly that.

Mixture-of-experts models: the routed experts' parameters always have their own gradient buffers and their
own optimizer, a chain (dense, experts), also at ep = 1 (`keep_routed_experts_apart`). megatron does this
only at ep > 1; doing it at every ep gives checkpoints one optimizer layout, so the optimizer state
reshards between ep = 2 and ep = 1 like the weights. At ep = 1 the expert buffers reduce over the
expert-data-parallel group, which then holds the same ranks as DP x CP: the same sums, the same scale.

Optimizer: Adam (AdamW-style decoupled weight decay) with global grad-norm clipping `clip_grad`.
The state is replicated over DP (no distributed optimizer), so a checkpoint can be resumed under
another DP or CP degree. Without transformer-engine and apex (the CPU path) megatron builds
`torch.optim.AdamW` with neither `foreach` nor `fused`, and torch then updates one parameter at a
time on CPU; `use_fused_adamw_on_cpu` switches those groups to torch's fused kernel (the same
update formula, ~1e-8 apart in fp32; 5-7x faster on the S and M shapes of bench/peers).

LoRA+ (`lora_plus_ratio`, Hayou et al. 2024): the adapters' B matrices (`*.lora_b`) form a param group of their
own whose peak and final learning rates are `lora_plus_ratio` x lr and x min_lr (megatron's per-group `max_lr`,
`min_lr` overrides, which its scheduler reads for every group); every other parameter keeps lr. megatron's standard
overrides (no weight decay on biases and 1-d parameters) are kept beside it.

Schedule (megatron's OptimizerParamScheduler, stepped once per optimizer step; `step` and the
warm-up count optimizer steps, num_steps_per_rollout x num_epochs of them per rollout step):
    step < warmup:  lr = lr_peak * step / warmup
    then            constant | linear | cosine decay from lr_peak to min_lr at step = total optimizer steps
"""

from __future__ import annotations

from typing import Any

import torch

DECAY_STYLES = ("constant", "linear", "cosine")

OPTIMIZER_CONFIG_SETTINGS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad")
"""The `OptimSection` settings that megatron's `OptimizerConfig` takes as they are, under the same names (the
schedule's settings go to `OptimizerParamScheduler`)."""


ROUTED_EXPERT_PARAM = ".mlp.experts."
"""In megatron's parameter names, the routed experts' (`decoder.layers.<i>.mlp.experts.local_experts.<j>...`;
a shared expert is `mlp.shared_experts`)."""


def keep_routed_experts_apart(model) -> int:
    """Mark the routed experts' parameters as megatron marks them at ep > 1 (`allreduce = False`), so DDP gives
    them their own buffers and `get_megatron_optimizer` its expert optimizer at any ep; returns how many
    parameters were marked here (0 at ep > 1 and for dense models)."""
    marked = 0
    for name, param in model.named_parameters():
        if ROUTED_EXPERT_PARAM in name and getattr(param, "allreduce", True):
            param.allreduce = False
            marked += 1
    return marked


def wrap_ddp(model):
    """megatron DistributedDataParallel over DP x CP, fp32 grad buffers, one sync per step; a mixture-of-experts
    model's routed experts in buffers of their own (`keep_routed_experts_apart`). A list of model chunks
    (virtual pipeline stages) gets one DDP per chunk, in a list."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        keep_routed_experts_apart(chunk)
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
    )
    if isinstance(model, (list, tuple)):
        return [DistributedDataParallel(chunk.config, config, chunk) for chunk in chunks]
    return DistributedDataParallel(model.config, config, model)


LORA_B_PARAMS = "*.lora_b"
"""The parameter names of the adapters' B matrices (`stacx.models.lora`), which LoRA+ gives their own learning rate."""


def build_optimizer(ddp_model, optim: Any, *, total_steps: int, lora_plus_ratio: float = 1.0):
    """(megatron optimizer, OptimizerParamScheduler) from an `OptimSection`-like object; `ddp_model` is one
    DDP model or a list of them (model chunks), all under one optimizer. `lora_plus_ratio` != 1: LoRA+ (the
    module doc), B's learning rate that many times lr."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if optim.lr_decay_style not in DECAY_STYLES:
        raise ValueError(f"lr_decay_style {optim.lr_decay_style!r} is not one of {DECAY_STYLES}")
    if optim.lr <= 0 or optim.min_lr < 0 or optim.min_lr > optim.lr:
        raise ValueError(f"lr ({optim.lr}) must be > 0 and min_lr ({optim.min_lr}) in [0, lr]")
    if optim.lr_warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps must be >= 0, got {optim.lr_warmup_steps}")
    chunks = list(ddp_model) if isinstance(ddp_model, (list, tuple)) else [ddp_model]
    dtype = chunks[0].module.config.params_dtype
    config = OptimizerConfig(
        optimizer="adam",
        **{name: getattr(optim, name) for name in OPTIMIZER_CONFIG_SETTINGS},
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=False,
    )
    if lora_plus_ratio <= 0:
        raise ValueError(f"--lora-plus-ratio must be > 0, got {lora_plus_ratio}")
    optimizer = get_megatron_optimizer(config, chunks, config_overrides=lora_plus_overrides(config, lora_plus_ratio))
    use_fused_adamw_on_cpu(optimizer)
    decay_steps = max(int(total_steps), optim.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def lora_plus_overrides(config, ratio: float):
    """megatron's `config_overrides` with LoRA+'s B group at `ratio` x the learning rates (None at ratio 1:
    megatron's standard overrides only)."""
    if ratio == 1.0:
        return None
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides

    overrides = get_standard_config_overrides(config)
    overrides[ParamKey(name=LORA_B_PARAMS)] = {"max_lr": config.lr * ratio, "min_lr": config.min_lr * ratio}
    return overrides


def torch_optimizers_of(megatron_optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrapper (one, or one per chain link)."""
    links = getattr(megatron_optimizer, "chained_optimizers", None) or [megatron_optimizer]
    return [link.optimizer for link in links]


def use_fused_adamw_on_cpu(megatron_optimizer) -> int:
    """Run torch's fused (multi-tensor) Adam/AdamW kernel for every param group whose parameters
    are all CPU floating-point tensors and that asked for neither `foreach` nor `fused`.

    megatron hands torch.optim.AdamW its params without these flags; on CPU torch's default is then
    the per-parameter loop. The fused CPU kernel applies the same update (decoupled weight decay,
    bias corrections, eps outside the square root) in one pass per tensor. A hook re-applies the
    choice after `load_state_dict`, which restores a checkpoint's own group flags. Returns the
    number of groups switched (0 with CUDA optimizers: TE's / apex's FusedAdam are not touched).
    """
    switched = 0
    for optimizer in torch_optimizers_of(megatron_optimizer):
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        switched += _switch_cpu_groups_to_fused(optimizer)
        if not getattr(optimizer, "_stacx_fused_on_cpu_hook", False):
            optimizer.register_load_state_dict_post_hook(_switch_cpu_groups_to_fused)
            optimizer._stacx_fused_on_cpu_hook = True
    return switched


def _switch_cpu_groups_to_fused(optimizer: torch.optim.Optimizer) -> int:
    switched = 0
    for group in optimizer.param_groups:
        params = group["params"]
        on_cpu = bool(params) and all(p.device.type == "cpu" and p.is_floating_point() for p in params)
        if not on_cpu or group.get("fused") or group.get("foreach") or group.get("differentiable"):
            continue
        group["foreach"], group["fused"] = False, True
        switched += 1
    return switched


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
