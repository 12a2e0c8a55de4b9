"""The CPU optimizer step runs torch's fused AdamW and updates exactly like megatron's per-parameter loop."""

import pytest
import torch

from stacx.trainer.config.run import OptimSection
from tests.serving.fixtures import single_process_world  # noqa: F401  (a fixture, found by name)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the switch applies to CPU parameters only")


def build_trainable(groups, *, fused: bool):
    """Tiny Qwen2 (seed 0) + megatron DDP + optimizer from build_optimizer; fused=False restores
    the per-parameter loop megatron builds (neither foreach nor fused)."""
    from stacx.models import build_model
    from stacx.models.testing import tiny_hf_config
    from stacx.trainer.runtime.optim import build_optimizer, torch_optimizers_of, wrap_ddp

    torch.manual_seed(0)
    model = build_model(tiny_hf_config("qwen2", vocab_size=64, max_position_embeddings=32), groups)
    ddp = wrap_ddp(model)
    optim = OptimSection(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.98, clip_grad=1.0)
    optimizer, _ = build_optimizer(ddp, optim, total_steps=10)
    if not fused:
        for torch_optimizer in torch_optimizers_of(optimizer):
            for group in torch_optimizer.param_groups:
                group["fused"], group["foreach"] = None, None
    return model, ddp, optimizer


def train_in_lockstep(loop_parts, fused_parts, groups, num_steps: int):
    """Each step: forward+backward on the loop model, the same gradients copied into the fused
    model, both optimizers step. (Separate forwards would let Adam amplify 1-ulp differences of
    near-zero gradients into lr-sized ones: that tests the data, not the update.)"""
    from stacx.models import forward_packed

    (loop_model, loop_ddp, loop_optimizer), (fused_model, fused_ddp, fused_optimizer) = loop_parts, fused_parts
    generator = torch.Generator().manual_seed(1)
    for _ in range(num_steps):
        for ddp, optimizer in ((loop_ddp, loop_optimizer), (fused_ddp, fused_optimizer)):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
        tokens = torch.randint(0, 64, (24,), generator=generator)
        logits = forward_packed(loop_ddp, tokens, [10, 14], groups)
        torch.nn.functional.cross_entropy(logits[:-1, :64], tokens[1:]).backward()
        loop_ddp.finish_grad_sync()
        for loop_param, fused_param in zip(loop_model.parameters(), fused_model.parameters()):
            fused_param.main_grad.copy_(loop_param.main_grad)
        for optimizer in (loop_optimizer, fused_optimizer):
            updated, _, _ = optimizer.step()
            assert updated
    return [p.detach().clone() for p in loop_model.parameters()], [p.detach().clone() for p in fused_model.parameters()]


def test_cpu_adamw_groups_are_fused_and_update_like_the_per_parameter_loop(single_process_world):
    from stacx.trainer.runtime.optim import torch_optimizers_of

    groups = single_process_world
    fused_parts = build_trainable(groups, fused=True)
    loop_parts = build_trainable(groups, fused=False)
    fused_groups = [g for o in torch_optimizers_of(fused_parts[2]) for g in o.param_groups]
    assert fused_groups and all(g["fused"] is True for g in fused_groups)
    loop_groups = [g for o in torch_optimizers_of(loop_parts[2]) for g in o.param_groups]
    assert not any(g["fused"] or g["foreach"] for g in loop_groups)
    initial = [p.detach().clone() for p in fused_parts[0].parameters()]

    loop_params, fused_params = train_in_lockstep(loop_parts, fused_parts, groups, num_steps=3)

    moved = max((a - b).abs().max().item() for a, b in zip(fused_params, initial))
    assert moved > 1e-2  # three steps at lr 1e-2 moved the weights: the comparison is not trivial
    worst = max((a - b).abs().max().item() for a, b in zip(fused_params, loop_params))
    assert worst <= 1e-6


def test_loading_a_checkpoint_saved_without_the_flag_keeps_the_fused_kernel(single_process_world):
    from stacx.trainer.runtime.optim import torch_optimizers_of

    groups = single_process_world
    _, _, loop_optimizer = build_trainable(groups, fused=False)
    _, _, fused_optimizer = build_trainable(groups, fused=True)
    fused_optimizer.load_state_dict(loop_optimizer.state_dict())  # groups saved with fused=None
    assert all(g["fused"] is True for o in torch_optimizers_of(fused_optimizer) for g in o.param_groups)
