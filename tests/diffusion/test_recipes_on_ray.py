"""Each of the six diffusion recipes trains 2 steps end to end on Ray through `stacx train`, on the
shared test Ray cluster, at tiny sizes (8x8 pixels, 2 layers, 3 denoising steps)."""

import json
import math

import pytest
import torch

from stacx.launch.cli import main
from stacx.trainer.recipes import TRAINING_CONFIGS
DIFFUSION_RECIPES = ("flow_matching_sft", "flow_grpo", "dance_grpo", "mix_grpo", "diffusion_dpo", "diffusion_nft")
TINY = ["--num-steps", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--lr", "1e-3",
        "--algorithm-param", "image_size=8", "--algorithm-param", "num_inference_steps=3",
        "--no-progress-bar", "--no-tensorboard"]


def _metrics(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_catalog_holds_the_six_experimental_image_recipes():
    for name in DIFFUSION_RECIPES:
        recipe = TRAINING_CONFIGS[name]
        assert recipe.experimental and recipe.modality == "image" and recipe.role("policy").trainable
    assert not any(r.experimental for n, r in TRAINING_CONFIGS.items() if n not in DIFFUSION_RECIPES)


def _run_config(*flags):
    import argparse

    from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(list(flags)))


def test_stacx_train_sends_a_diffusion_recipe_to_its_loop(capsys):
    assert main(["train", "--algorithm", "mix_grpo", *TINY, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "recipe mix_grpo (experimental, image)" in out and "'sde_window_size': 2" in out
    assert "'num_inference_steps': 3" in out and "'image_size': 8" in out  # --algorithm-param reached the settings
    assert main(["train", "--algorithm", "flow_grpo", "--algorithm-param", "sde_sigma_schedul=dance_grpo",
                 "--dry-run"]) == 2
    assert "did you mean 'sde_sigma_schedule'" in capsys.readouterr().err
    assert main(["train", "--algorithm", "flow_grpo", "--tensor-model-parallel-size", "2", "--dry-run"]) == 2
    assert "the diffusion recipes run data parallel only" in capsys.readouterr().err
    # an uneven split is refused with the flags, before any worker starts (not at the first step)
    assert main(["train", "--algorithm", "flow_grpo", "--data-parallel-size", "2", "--rollout-batch-size", "3",
                 "--dry-run"]) == 2
    assert "--rollout-batch-size 3 must be divisible by --data-parallel-size 2" in capsys.readouterr().err


@pytest.mark.slow
def test_each_diffusion_recipe_trains_two_steps_on_ray(ray_address, tmp_path):
    """One cluster and one set of policy workers, 2 data-parallel ranks (the six recipes share the role
    graph), six runs; the two replicas stay identical (gradients averaged over DP)."""
    from stacx.diffusion.checkpoint import load_diffusion_model
    from stacx.diffusion.group import DiffusionPolicyGroup
    from stacx.diffusion.loop import run_diffusion_training
    from stacx.diffusion.models import DiffusionModel
    from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers

    graph = create_role_workers(TRAINING_CONFIGS["flow_grpo"], WorkerLayout(data_parallel_size=2))
    try:
        sft_ckpt = tmp_path / "sft_ckpt"
        run_config = _run_config("--algorithm", "flow_matching_sft", *TINY, "--out", str(tmp_path / "sft"),
                                 "--save", str(sft_ckpt), "--seed", "5")
        run_diffusion_training(run_config, TRAINING_CONFIGS["flow_matching_sft"], graph=graph, log=lambda _: None)
        assert len(_metrics(tmp_path / "sft")) == 2
        trained = load_diffusion_model(str(sft_ckpt))
        torch.manual_seed(5)  # the worker built its initial model under the run's seed
        initial = DiffusionModel(trained.config)
        assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters())), "SFT did not train"
        for name in DIFFUSION_RECIPES[1:]:
            out = tmp_path / name
            extra = ["--ref-load", str(sft_ckpt)] if name == "diffusion_dpo" else []
            run_config = _run_config("--algorithm", name, *TINY, "--hf-checkpoint", str(sft_ckpt), "--out", str(out),
                                     *extra)
            run_diffusion_training(run_config, TRAINING_CONFIGS[name], graph=graph, log=lambda _: None)
            rows = _metrics(out)
            assert [row["step"] for row in rows] == [0, 1], name
            assert all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in rows), (name, rows)
            if TRAINING_CONFIGS[name].uses_reward:
                assert all(0.0 <= row["reward_mean"] <= 1.0 for row in rows), name
            first, second = DiffusionPolicyGroup.on_built_workers(graph.workers["policy"]).parameter_checksums()
            assert first == pytest.approx(second, rel=1e-6), name
        # the DiT family (label conditioner) built from scratch, no checkpoint
        run_config = _run_config("--algorithm", "diffusion_nft", *TINY, "--algorithm-param", "model_family=dit",
                                 "--out", str(tmp_path / "dit"))
        run_diffusion_training(run_config, TRAINING_CONFIGS["diffusion_nft"], graph=graph, log=lambda _: None)
        assert [row["step"] for row in _metrics(tmp_path / "dit")] == [0, 1]
    finally:
        graph.shutdown()
