"""megatron-core DDP, optimizer and LR scheduler for one trainable role, from the run's `optim` section.

    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, optim_section, total_steps=train.num_steps)

DDP: gradients accumulate in fp32 buffers over a step's micro-batches and are all-reduced over
DP x CP once, in `finish_grad_sync` (no overlap: the step's micro-batches run back to back and a
single sync keeps the number of collectives independent of the micro-batch count). megatron scales
the summed gradients by 1 / (dp * cp); the reducer's `gradient_scale` undoes exactly that.

Optimizer: Adam (AdamW-style decoupled weight decay) with global grad-norm clipping `clip_grad`.
The state is replicated over DP (no distributed optimizer), so a checkpoint can be resumed under
another DP or CP degree.

Schedule (megatron's OptimizerParamScheduler, stepped once per optimizer step):
    step < warmup:  lr = lr_peak * step / warmup
    then            constant | linear | cosine decay from lr_peak to min_lr at step = num_steps
"""

from __future__ import annotations

from typing import Any

import torch

DECAY_STYLES = ("constant", "linear", "cosine")


def wrap_ddp(model):
    """megatron DistributedDataParallel over DP x CP, fp32 grad buffers, one sync per step."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
    )
    return DistributedDataParallel(model.config, config, model)


def build_optimizer(ddp_model, optim: Any, *, total_steps: int):
    """(megatron optimizer, OptimizerParamScheduler) from an `OptimSection`-like object."""
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if optim.lr_decay_style not in DECAY_STYLES:
        raise ValueError(f"lr_decay_style {optim.lr_decay_style!r} is not one of {DECAY_STYLES}")
    if optim.lr <= 0 or optim.min_lr < 0 or optim.min_lr > optim.lr:
        raise ValueError(f"lr ({optim.lr}) must be > 0 and min_lr ({optim.min_lr}) in [0, lr]")
    if optim.lr_warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps must be >= 0, got {optim.lr_warmup_steps}")
    dtype = ddp_model.module.config.params_dtype
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
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


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
