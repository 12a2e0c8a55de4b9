"""--weight-decay on LoRA adapters, in-process on one gloo rank: megatron's standard param groups decay every
parameter of two or more dims, so A and B are decayed (AdamW-style, decoupled) like full fine-tuning's weights,
with or without LoRA+'s group for B, and the frozen base weights are in no group at all. One real step shows it:
while B is zero A's gradient is zero, so Adam moves A by its decay alone, A <- (1 - lr * wd) A."""

from __future__ import annotations

import pytest
import torch

from stacx.models.lora import LoraSettings
from stacx.trainer.config.run import OptimSection
from tests.models.test_lora_plus_and_rslora import _adapted_model
from tests.serving.fixtures import single_process_world  # noqa: F401  (a fixture, found by name)

LR, WD = 1e-2, 0.1


def _adapter_weight_decays(optimizer, model) -> dict[str, set[float]]:
    """{'lora_a' / 'lora_b' / 'base': the weight decays of the torch param groups holding such parameters}."""
    from stacx.models.lora import adapted_linears
    from stacx.trainer.runtime.optim import torch_optimizers_of

    kinds = {}
    for linear in adapted_linears(model):
        kinds[id(linear.lora_a)], kinds[id(linear.lora_b)], kinds[id(linear.weight)] = "lora_a", "lora_b", "base"
    found: dict[str, set[float]] = {"lora_a": set(), "lora_b": set(), "base": set()}
    for torch_optimizer in torch_optimizers_of(optimizer):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                if id(param) in kinds:
                    found[kinds[id(param)]].add(group["weight_decay"])
    return found


@pytest.mark.parametrize("lora_plus_ratio", [1.0, 4.0])
def test_weight_decay_applies_to_the_adapters_and_shrinks_a_while_b_is_zero(single_process_world, lora_plus_ratio):
    from stacx.models import forward_packed
    from stacx.models.lora import adapted_linears
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    groups = single_process_world
    model = _adapted_model(groups, LoraSettings(rank=4, alpha=8))
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, OptimSection(lr=LR, weight_decay=WD, clip_grad=0.0), total_steps=4,
                                           lora_plus_ratio=lora_plus_ratio)
    scheduler.step(0)
    decays = _adapter_weight_decays(optimizer, model)
    assert decays == {"lora_a": {WD}, "lora_b": {WD}, "base": set()}, decays

    linears = adapted_linears(model)
    a_before = [linear.lora_a.detach().clone() for linear in linears]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(3))
    torch.nn.functional.cross_entropy(forward_packed(ddp, tokens, [10, 14], groups)[:-1, :64], tokens[1:]).backward()
    ddp.finish_grad_sync()
    assert all(not linear.lora_a.main_grad.any() for linear in linears)  # B = 0: no gradient reaches A
    updated, _, _ = optimizer.step()
    assert updated
    for linear, before in zip(linears, a_before):
        assert torch.allclose(linear.lora_a.detach(), (1 - LR * WD) * before, rtol=0, atol=1e-7)
        assert linear.lora_b.detach().abs().max() > 0  # B took its Adam step


def test_without_weight_decay_a_does_not_move_while_b_is_zero(single_process_world):
    from stacx.models import forward_packed
    from stacx.models.lora import adapted_linears
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    groups = single_process_world
    model = _adapted_model(groups, LoraSettings(rank=4, alpha=8))
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, OptimSection(lr=LR, clip_grad=0.0), total_steps=4)
    scheduler.step(0)
    a_before = [linear.lora_a.detach().clone() for linear in adapted_linears(model)]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(3))
    torch.nn.functional.cross_entropy(forward_packed(ddp, tokens, [10, 14], groups)[:-1, :64], tokens[1:]).backward()
    ddp.finish_grad_sync()
    optimizer.step()
    assert all(torch.equal(linear.lora_a.detach(), before) for linear, before in zip(adapted_linears(model), a_before))
