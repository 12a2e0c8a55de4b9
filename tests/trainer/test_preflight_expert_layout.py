"""Preflight of a mixture-of-experts run: experts by --expert-model-parallel-size, expert width by
--expert-tensor-parallel-size, ep x etp by the role's ranks; each refusal names the flag and the fix."""

from __future__ import annotations

import pytest

from stacx.trainer.config.run import RunConfig
from stacx.trainer.preflight import PreflightError, check_expert_layout


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    from stacx.models.testing import tiny_hf_config

    root = tmp_path_factory.mktemp("expert_layout")
    folders = {}
    for arch in ("qwen3_moe", "qwen3"):  # 4 experts of width 32; a dense model
        folders[arch] = str(root / arch)
        tiny_hf_config(arch).save_pretrained(folders[arch])
    return folders


def _run(folder, **parallel):
    return RunConfig.from_dict({"hf_checkpoint": folder, **parallel})


def test_layouts_that_divide_the_experts_and_the_world_pass(configs):
    check_expert_layout(_run(configs["qwen3_moe"], expert_model_parallel_size=2, data_parallel_size=2))
    check_expert_layout(_run(configs["qwen3_moe"], expert_model_parallel_size=4, data_parallel_size=2,
                             context_parallel_size=2))
    check_expert_layout(_run(configs["qwen3"]))
    check_expert_layout(_run(configs["qwen3_moe"], tensor_model_parallel_size=2, expert_model_parallel_size=2,
                             expert_tensor_parallel_size=1, sequence_parallel=True))


@pytest.mark.parametrize("parallel, message", [
    (dict(expert_model_parallel_size=3, data_parallel_size=3),
     r"--expert-model-parallel-size 3 does not divide the model's num_experts 4 .*use one of \[1, 2, 4\]"),
    (dict(expert_model_parallel_size=4, data_parallel_size=2),
     r"--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 does not divide the role's 2 ranks"),
    (dict(expert_tensor_parallel_size=3, data_parallel_size=3),
     r"--expert-tensor-parallel-size 3 does not divide the model's moe_intermediate_size 32"),
    (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
     r"--tensor-model-parallel-size 2 with a mixture-of-experts model needs sequence parallelism .*"
     r"add --sequence-parallel"),
])
def test_layouts_that_do_not_fit_are_refused_naming_the_flag(configs, parallel, message):
    with pytest.raises(PreflightError, match=message):
        check_expert_layout(_run(configs["qwen3_moe"], **parallel))


def test_expert_parallelism_on_a_dense_model_is_refused(configs):
    with pytest.raises(PreflightError, match=r"--expert-model-parallel-size 2 .*need a mixture-of-experts model"):
        check_expert_layout(_run(configs["qwen3"], expert_model_parallel_size=2, data_parallel_size=2))


def test_router_loss_coefficients_are_run_settings():
    run = RunConfig.from_dict({"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001})
    assert (run.model.moe_aux_loss_coeff, run.model.moe_z_loss_coeff) == (0.01, 0.001)
    with pytest.raises(ValueError, match="moe_aux_loss_coeff"):
        RunConfig.from_dict({"moe_aux_loss_coeff": -1.0})


def test_routing_replay_needs_routed_experts_and_a_rollout_that_returns_them(configs):
    from types import SimpleNamespace

    from stacx.trainer.preflight import check_routing_replay

    grpo = SimpleNamespace(rollin_protocol=None, name="grpo")
    check_routing_replay(_run(configs["qwen3_moe"], use_routing_replay=True), grpo)
    check_routing_replay(_run(configs["qwen3"]), grpo)  # off: nothing to check
    refusals = [
        (_run(configs["qwen3"], use_routing_replay=True), grpo, r"--use-routing-replay needs a mixture-of-experts"),
        (_run(configs["qwen3_moe"], use_routing_replay=True, agent="a.py:run"), grpo, r"--use-routing-replay with --agent"),
        (_run(configs["qwen3_moe"], use_routing_replay=True), SimpleNamespace(rollin_protocol="student_rollin",
                                                                               name="online_dagger"), r"roll-in"),
    ]
    for run, recipe, message in refusals:
        with pytest.raises(PreflightError, match=message):
            check_routing_replay(run, recipe)
