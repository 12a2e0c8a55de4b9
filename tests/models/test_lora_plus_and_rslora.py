"""LoRA+ (--lora-plus-ratio: B's learning rate a multiple of A's) and rsLoRA (--lora-rslora: alpha / sqrt(r)),
in-process on one gloo rank: the flags' checks, the optimizer's param groups and one real Adam step, the scale
on the adapted linears and in the PEFT configs (the PEFT round trip with use_rslora is in
tests/checkpointing/test_lora_export.py)."""

from __future__ import annotations

import math

import pytest
import torch

from stacx.models.lora import LoraSettings, engine_adapter_config, peft_adapter_config
from stacx.trainer.config.run import ConfigError, OptimSection, RunConfig, engine_lora_flags
from tests.serving.fixtures import single_process_world  # noqa: F401  (a fixture, found by name)

LR, RATIO = 1e-3, 16.0


@pytest.mark.parametrize("values, message", [
    ({"lora_rank": 8, "lora_plus_ratio": 0}, "--lora-plus-ratio must be > 0"),
    ({"lora_rank": 8, "lora_plus_ratio": -16}, "--lora-plus-ratio must be > 0"),
    ({"lora_plus_ratio": 16}, "--lora-plus-ratio 16.* --lora-rank is 0"),
    ({"lora_rslora": True}, "--lora-rslora True .* --lora-rank is 0"),
])
def test_a_wrong_lora_plus_or_rslora_flag_is_named(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(values)


def test_the_flags_reach_the_model_section_and_default_to_plain_lora():
    plain = RunConfig.from_dict({"lora_rank": 8}).model
    assert (plain.lora_plus_ratio, plain.lora_rslora) == (1.0, False)
    model = RunConfig.from_dict({"lora_rank": 8, "lora_plus_ratio": 16, "lora_rslora": True}).model
    assert (model.lora_plus_ratio, model.lora_rslora) == (16.0, True)


def test_rslora_scales_by_alpha_over_sqrt_rank_and_says_so_in_the_peft_config():
    settings = LoraSettings(rank=8, alpha=16, rslora=True)
    assert settings.scale == 16 / math.sqrt(8) and LoraSettings(rank=8, alpha=16).scale == 2.0
    assert peft_adapter_config(settings, "base")["use_rslora"] is True
    assert peft_adapter_config(LoraSettings(rank=8, alpha=16), "base")["use_rslora"] is False
    # An engine given adapters (vLLM, SGLang) gets the same scale as a plain lora_alpha / r.
    engine = engine_adapter_config(settings)
    assert engine["use_rslora"] is False and engine["lora_alpha"] / engine["r"] == pytest.approx(settings.scale, rel=1e-15)


def test_an_adapter_sync_passes_rslora_to_the_cpu_server():
    from stacx.launch.cli import build_parser

    model = RunConfig.from_dict({"lora_rank": 8, "lora_alpha": 16, "lora_rslora": True, "lora_sync": "adapters"}).model
    args = build_parser().parse_args(["serve", "--hf-checkpoint", "x", *engine_lora_flags(model)])
    assert (args.lora_rank, args.lora_alpha, args.lora_rslora) == (8, 16.0, True)
    plain = RunConfig.from_dict({"lora_rank": 8, "lora_sync": "adapters"}).model
    assert build_parser().parse_args(["serve", "--hf-checkpoint", "x", *engine_lora_flags(plain)]).lora_rslora is False


def _adapted_model(groups, settings: LoraSettings):
    from stacx.models import build_model
    from stacx.models.lora import attach_lora
    from stacx.models.testing import tiny_hf_config

    torch.manual_seed(0)
    model = build_model(tiny_hf_config("qwen2", vocab_size=64, max_position_embeddings=32), groups)
    attach_lora(model, settings, groups)
    return model


def test_rslora_adapters_compute_alpha_over_sqrt_rank_times_b_a(single_process_world):
    from stacx.models.lora import adapted_linears

    settings = LoraSettings(rank=4, alpha=8, rslora=True)
    linear = adapted_linears(_adapted_model(single_process_world, settings))[0]
    assert linear.lora_scale == 8 / 2
    with torch.no_grad():
        linear.lora_b.copy_(torch.randn(linear.lora_b.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 1, linear.weight.shape[1], generator=torch.Generator().manual_seed(2))
    expected = (8 / math.sqrt(4)) * x @ (linear.lora_b @ linear.lora_a).T
    assert torch.allclose(linear.lora_delta(x), expected, atol=1e-5, rtol=1e-5)  # alpha / r would be half


def _groups_by_kind(optimizer) -> dict[str, list[float]]:
    """{'lora_a' / 'lora_b': the lr of every torch param group that holds such parameters}."""
    from stacx.trainer.runtime.optim import torch_optimizers_of

    found: dict[str, list[float]] = {"lora_a": [], "lora_b": []}
    for torch_optimizer in torch_optimizers_of(optimizer):
        for group in torch_optimizer.param_groups:
            kinds = {getattr(p, "_test_kind", None) for p in group["params"]}
            for kind in kinds - {None}:
                found[kind].append(group["lr"])
    return found


def test_lora_plus_gives_b_ratio_times_the_learning_rate_through_the_schedule_and_one_adam_step(single_process_world):
    from stacx.models import forward_packed
    from stacx.models.lora import adapted_linears
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    groups = single_process_world
    model = _adapted_model(groups, LoraSettings(rank=4, alpha=8))
    for linear in adapted_linears(model):
        linear.lora_a._test_kind, linear.lora_b._test_kind = "lora_a", "lora_b"
    ddp = wrap_ddp(model)
    optim = OptimSection(lr=LR, min_lr=LR / 10, lr_warmup_steps=2, lr_decay_style="linear", clip_grad=0.0)
    optimizer, scheduler = build_optimizer(ddp, optim, total_steps=6, lora_plus_ratio=RATIO)
    for _ in range(6):  # warm-up, decay, then min_lr: B's rate is RATIO x A's at every step
        scheduler.step(1)
        lrs = _groups_by_kind(optimizer)
        assert len(set(lrs["lora_a"])) == 1 and len(set(lrs["lora_b"])) == 1, lrs
        assert lrs["lora_b"][0] == pytest.approx(RATIO * lrs["lora_a"][0], rel=1e-12) and lrs["lora_a"][0] > 0

    # One real step at the peak (a fresh scheduler): Adam's first update moves each entry by its group's lr.
    optimizer, scheduler = build_optimizer(ddp, OptimSection(lr=LR, clip_grad=0.0), total_steps=6,
                                           lora_plus_ratio=RATIO)
    before = [p.detach().clone() for linear in adapted_linears(model) for p in (linear.lora_b,)]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(3))
    logits = forward_packed(ddp, tokens, [10, 14], groups)
    torch.nn.functional.cross_entropy(logits[:-1, :64], tokens[1:]).backward()
    ddp.finish_grad_sync()
    updated, _, _ = optimizer.step()
    assert updated
    moved = torch.cat([(linear.lora_b.detach() - b).abs().flatten()
                       for linear, b in zip(adapted_linears(model), before)])
    # |g| / (|g| + eps) of Adam's first step: RATIO x LR for every entry whose gradient is not tiny, never more.
    assert moved.max().item() == pytest.approx(RATIO * LR, rel=1e-4) and moved.max().item() <= RATIO * LR * (1 + 1e-6)
    assert (moved > 0.99 * RATIO * LR).float().mean() > 0.9


def test_without_lora_plus_every_adapter_keeps_the_one_learning_rate(single_process_world):
    from stacx.models.lora import adapted_linears
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    model = _adapted_model(single_process_world, LoraSettings(rank=4, alpha=8))
    for linear in adapted_linears(model):
        linear.lora_a._test_kind, linear.lora_b._test_kind = "lora_a", "lora_b"
    optimizer, _ = build_optimizer(wrap_ddp(model), OptimSection(lr=LR), total_steps=4)
    lrs = _groups_by_kind(optimizer)
    assert set(lrs["lora_a"]) == set(lrs["lora_b"]) == {LR}


@pytest.mark.parametrize("values, message", [
    ({"lora_rank": 8, "lora_init": "pissa"}, "--lora-init"),
    ({"lora_init": "principal"}, "--lora-init principal .* --lora-rank is 0"),
])
def test_a_wrong_lora_init_is_named(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(values)
    with pytest.raises(ValueError, match="--lora-init 'pissa'"):
        LoraSettings(rank=4, alpha=8, init="pissa")


def test_principal_init_starts_a_along_the_base_weights_top_right_singular_vectors(single_process_world):
    from stacx.models.lora import adapted_linears

    model = _adapted_model(single_process_world, LoraSettings(rank=4, alpha=8, init="principal"))
    random_rows = adapted_linears(_adapted_model(single_process_world, LoraSettings(rank=4, alpha=8)))[0].lora_a
    for linear in adapted_linears(model):
        a, weight = linear.lora_a.detach().double(), linear.weight.detach().double()
        _, _, vt = torch.linalg.svd(weight, full_matrices=False)
        # Rows orthogonal, each at the random init's expected row norm sqrt(1/3); they span W's top-4 input directions.
        assert torch.allclose(a @ a.T, torch.eye(4, dtype=torch.float64) / 3, atol=1e-6)
        projector = vt[:4].T @ vt[:4]
        assert torch.allclose(a @ projector, a, atol=1e-6), "A leaves W's principal input subspace"
        assert torch.count_nonzero(linear.lora_b) == 0  # the run starts from the base model
    assert random_rows.norm(dim=1).mean().item() == pytest.approx(1 / math.sqrt(3), rel=0.15)
    with pytest.raises(ValueError, match="--lora-rank 80 exceeds the rank"):
        _adapted_model(single_process_world, LoraSettings(rank=80, alpha=8, init="principal"))


def test_principal_init_is_the_same_for_any_row_order_of_the_gathered_weight():
    """TP layouts gather megatron's qkv and gate/up rows in another order: the same A (signs fixed) either way."""
    from stacx.models.lora import _principal_a

    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(4))
    a = _principal_a(weight, 8)
    permuted = _principal_a(weight[torch.randperm(48, generator=torch.Generator().manual_seed(5))], 8)
    assert torch.allclose(a, permuted, atol=1e-6)
    largest = a.gather(1, a.abs().argmax(dim=1, keepdim=True))
    assert bool((largest > 0).all())
