"""`--lora-init gradient` / `gradient-sign`: A from the base weights' gradients on the first training batch.

One spawn of one rank (the reference) and one of two gloo ranks (TP=2 with sequence parallelism, CP=2, PP=2 on a
dense Qwen3; EP=2 on a Qwen3-MoE, adapters on the routed experts too) each build a `RoleRuntime` with
`--lora-init gradient` and run its first train step. Every layout must start from the single rank's A to 1e-6 (a
routed expert's: its subspace to 1e-6, each direction to 1e-5, see below; A takes no step on the first train step:
its gradient is zero while B is), with B zero before the step and moved after it. On the single rank A must be the top input directions of the gradient that full fine-tuning's DDP
computes for the same batch (megatron's own gradient path, not the one the init reads), and `gradient-sign`'s those
of that gradient's sign.
"""

from __future__ import annotations

import pytest
import torch

from stacx.testing.distributed import run_distributed
from tests.models.test_lora import checkpoints  # noqa: F401 (the same tiny Qwen3 and Qwen3-MoE folders)

# (arch, tp, cp, pp, ep)
LAYOUTS = [("qwen3", 2, 1, 1, 1), ("qwen3", 1, 2, 1, 1), ("qwen3", 1, 1, 2, 1), ("qwen3_moe", 1, 1, 1, 2)]
SINGLE = [("qwen3", 1, 1, 1, 1), ("qwen3_moe", 1, 1, 1, 1)]
RANK = 4
TOLERANCE = 1e-6


def _runtime(path, groups, layout, values):
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.specializations.actor import ActorSpecialization
    from stacx.trainer.config.recipe import ModelRole
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    _, tp, cp, pp, ep = layout
    run_config = RunConfig.from_dict({
        "hf_checkpoint": path, "clip_grad": 0.0, "lr": 1e-2, "tensor_model_parallel_size": tp,
        "context_parallel_size": cp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep,
        "sequence_parallel": tp > 1, **values})
    algorithm = AlgorithmConfig.from_values({"advantage_estimator": "grpo", "rollout_temperature": 0.7})
    role = ModelRole(name="policy", specialization_cls=ActorSpecialization)
    return RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                       train=run_config.train, rank=torch.distributed.get_rank())


def _adapters(runtime, which: str) -> dict[str, torch.Tensor]:
    """Full PEFT-named A or B tensors (`.lora_A.` / `.lora_B.`) of the runtime (the first stage receives all)."""
    from stacx.models import iter_hf_weight_buckets

    return {name: tensor.clone() for bucket in iter_hf_weight_buckets(runtime.model, runtime.groups, 1 << 30,
                                                                      adapters=True)
            for name, tensor in bucket if which in name}


def _first_step(runtime):
    from stacx.parallel.reduction import compute_step_counts
    from tests.trainer.runtime.test_lm_head_mode import step_batch

    batch = step_batch()
    micro_batches = [batch.select([0, 2]), batch.select([1, 3])]
    return runtime.train_step(micro_batches, compute_step_counts(batch.loss_masks, runtime.groups.dp))


def _full_gradients(path, groups, layout) -> dict[str, torch.Tensor]:
    """{adapted linear's megatron name: full fine-tuning's reduced gradient of its weight} at the start model."""
    from stacx.models.builder import unwrap_model
    from stacx.models.lora import target_of

    runtime = _runtime(path, groups, layout, {})
    _first_step(runtime)
    return {name: module.weight.main_grad.double() for name, module in unwrap_model(runtime.model).named_modules()
            if target_of(name) is not None}


def _full_fine_tuning_directions(path, groups, layout) -> dict[str, dict[str, torch.Tensor]]:
    """{init: {adapted linear's megatron name: the expected A}} from full fine-tuning's reduced gradient."""
    from stacx.models.lora import top_input_directions

    first = _full_gradients(path, groups, layout)
    return {"gradient": {name: top_input_directions(grad, RANK) for name, grad in first.items()},
            "gradient-sign": {name: top_input_directions(grad.sign(), RANK) for name, grad in first.items()}}


def run_layouts(_groups, paths, layouts, single: bool):
    from stacx.models.builder import unwrap_model
    from stacx.parallel.groups import initialize_parallel_layout

    results = {}
    for layout in layouts:
        arch, tp, cp, pp, ep = layout
        groups = initialize_parallel_layout(tp, cp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                                            expert_tensor_parallel_size=1)
        for init in ("gradient", "gradient-sign") if single else ("gradient",):
            runtime = _runtime(paths[arch], groups, layout, {"lora_rank": RANK, "lora_alpha": 8.0, "lora_init": init})
            random_a = _adapters(runtime, ".lora_A.")
            b_before = _adapters(runtime, ".lora_B.")
            _first_step(runtime)
            result = {"random_a": random_a, "a": _adapters(runtime, ".lora_A."), "b_before": b_before,
                      "b_after": _adapters(runtime, ".lora_B."), "awaits": runtime.adapters_await_gradients}
            if single:
                result["a_local"] = {name: module.lora_a.detach().clone()
                                     for name, module in unwrap_model(runtime.model).named_modules()
                                     if hasattr(module, "lora_a")}
            results[(layout, init)] = result
        if single:
            results[(layout, "full")] = _full_fine_tuning_directions(paths[arch], groups, layout)
    return results


@pytest.mark.slow  # two spawns, eleven RoleRuntimes
@pytest.mark.distributed
def test_every_layout_starts_from_the_single_ranks_gradient_directions(checkpoints):
    single = run_distributed(run_layouts, 1, args=(checkpoints, SINGLE, True), timeout_s=600)[0]
    sharded = run_distributed(run_layouts, 2, args=(checkpoints, LAYOUTS, False), timeout_s=600)
    for layout in SINGLE:
        expected = single[(layout, "full")]
        for init in ("gradient", "gradient-sign"):
            got = single[(layout, init)]
            assert not got["awaits"] and got["a"], (layout, init)
            assert all(not b.any() for b in got["b_before"].values()), "B must start at zero"
            assert all(b.any() for b in got["b_after"].values()), f"{layout} {init}: B did not move in the first step"
            assert got["a_local"].keys() == expected[init].keys()
            for name, a in got["a_local"].items():
                assert torch.allclose(a, expected[init][name], atol=1e-5, rtol=0), f"{layout} {init}: {name}"
                assert a.norm(dim=1).sub(3 ** -0.5).abs().max() < 1e-5  # the random init's row norm
            differs = [not torch.allclose(a, got["random_a"][n], atol=1e-3) for n, a in got["a"].items()]
            assert all(differs), f"{layout} {init}: an A kept its random init"
        assert any(not torch.allclose(single[(layout, "gradient")]["a"][n], a, atol=1e-3)
                   for n, a in single[(layout, "gradient-sign")]["a"].items()), "the sign changes no direction"
    for layout in LAYOUTS:
        reference = single[((layout[0], 1, 1, 1, 1), "gradient")]["a"]
        assert sharded[0][(layout, "gradient")]["a"].keys() == reference.keys(), layout  # rank 0 receives every A
        for rank, results in enumerate(sharded):
            got = results[(layout, "gradient")]
            assert not got["awaits"]
            for name, a in got["a"].items():
                where = f"{layout} rank {rank}: {name}"
                if ".experts." not in name:
                    assert torch.allclose(a, reference[name], atol=TOLERANCE, rtol=0), where
                    continue
                # A routed expert's gradient sums its tokens in another order at ep = 2 (float32), and the tiny
                # model's experts have close singular values (layer 1 expert 3's down_proj: 0.0100 and 0.0091 at
                # ranks 3 and 4), which rotates such a pair within the subspace by up to ~1e-6: the subspace
                # (A's projector) must agree to 1e-6, each direction to 1e-5.
                assert torch.allclose(3 * a.T @ a, 3 * reference[name].T @ reference[name], atol=TOLERANCE), where
                assert torch.allclose(a, reference[name], atol=1e-5, rtol=0), where


@pytest.mark.parametrize("values, message", [
    ({"lora_init": "gradient"}, "--lora-init gradient .* --lora-rank is 0"),
    ({"lora_rank": 8, "lora_init": "gradients"}, "lora_init"),
])
def test_a_wrong_gradient_init_setting_is_named(values, message):
    from stacx.trainer.config.run import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(values)


def test_the_gradient_inits_reach_the_model_section():
    from stacx.trainer.config.run import RunConfig

    assert RunConfig.from_dict({"lora_rank": 8, "lora_init": "gradient-sign"}).model.lora_init == "gradient-sign"
    assert RunConfig.from_dict({"lora_rank": 8, "lora_init": "gradient"}).model.lora_init == "gradient"


def test_top_input_directions_fill_missing_directions_from_the_fallback_orthogonally():
    from stacx.models.lora import top_input_directions

    generator = torch.Generator().manual_seed(0)
    rank_two = torch.randn(6, 2, generator=generator) @ torch.randn(2, 10, generator=generator)
    fallback = torch.randn(4, 10, generator=generator)
    a = top_input_directions(rank_two, 4, fallback=fallback).double()
    assert torch.allclose(a @ a.T, torch.eye(4, dtype=torch.float64) / 3, atol=1e-6)
    top = torch.linalg.svd(rank_two.double(), full_matrices=False)[2][:2]
    assert torch.allclose(a[:2] @ top.T @ top, a[:2], atol=1e-6)  # the matrix's own two directions first
    assert torch.allclose(top_input_directions(torch.zeros(6, 10), 4, fallback=fallback).double() @ fallback.T.double()
                          @ torch.linalg.inv(fallback.double() @ fallback.T.double()) @ fallback.double(),
                          top_input_directions(torch.zeros(6, 10), 4, fallback=fallback).double(), atol=1e-6)
    with pytest.raises(ValueError, match="no 4 input directions"):
        top_input_directions(rank_two, 4)
