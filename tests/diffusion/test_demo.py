"""`stacx demo --diffusion` with reduced step counts: both phases run and every output is written."""

import json

import pytest

from stacx.launch.demo.diffusion import DiffusionDemoSettings, format_summary, run_diffusion_demo
from stacx.launch.demo.phases import OnPolicyPhase, SftPhase


@pytest.mark.slow
def test_diffusion_demo_writes_summary_sample_grid_and_reward_curve(tmp_path):
    settings = DiffusionDemoSettings(sft=SftPhase(recipe="flow_matching_sft", steps=6, batch_size=8, lr=2e-3),
                                     rl=OnPolicyPhase(recipe="flow_grpo", steps=2, prompts_per_step=2, samples_per_prompt=2,
                                                      lr=1e-3),
                                     eval_every=1, eval_samples_per_prompt=1, num_inference_steps=3)
    summary = run_diffusion_demo(settings, str(tmp_path), log=lambda _: None)
    with open(tmp_path / "summary.json") as f:
        assert json.load(f) == json.loads(json.dumps(summary))
    figures = summary["held_out_reward"]
    assert set(figures) == {"initial", "after_sft", "after_flow_grpo"}
    assert all(0.0 <= value <= 1.0 for value in figures.values())
    assert [step for step, _ in summary["held_out_curve"]] == [0, 1, 2]
    assert summary["held_out_curve"][-1][1] == pytest.approx(figures["after_flow_grpo"])
    assert len(summary["train_reward_curve"]) == 2 and len(summary["sft_loss_curve"]) == 6
    from PIL import Image

    grid = Image.open(tmp_path / "samples.png")
    assert grid.size == (4 * 90, 3 * 110 + 60)  # 4 held-out samples per row, one row per stage (0.9 x 1.1 in at 100 dpi)
    assert Image.open(tmp_path / "reward_curve.png").size[0] > 0
    assert (tmp_path / "checkpoints" / "flow_grpo" / "model_index.json").is_file()
    assert "after Flow-GRPO" in format_summary(summary)
