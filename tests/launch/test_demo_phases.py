"""The demos' shared phase knobs become the run-config keys of a real run (no training here)."""

from stacx.launch.demo.agent import AgentDemoSettings
from stacx.launch.demo.phases import OnPolicyPhase, demo_run_config
from stacx.launch.demo.pipeline import DemoSettings


def test_sft_and_grpo_phase_knobs_reach_their_run_config_sections(tmp_path):
    settings = DemoSettings(progress_bar=False)
    sft = demo_run_config(settings, str(tmp_path), "sft", settings.sft.run_values())
    assert (sft.train.algorithm, sft.train.num_steps, sft.rollout.rollout_batch_size, sft.optim.lr) == (
        "sft", settings.sft.steps, settings.sft.batch_size, settings.sft.lr)
    grpo = demo_run_config(settings, str(tmp_path), "grpo", settings.grpo.run_values())
    assert (grpo.train.algorithm, grpo.train.num_steps, grpo.rollout.rollout_batch_size,
            grpo.rollout.n_samples_per_prompt, grpo.optim.lr) == (
        "grpo", settings.grpo.steps, settings.grpo.prompts_per_step, settings.grpo.samples_per_prompt, settings.grpo.lr)
    assert grpo.algorithm.use_kl_loss and grpo.algorithm.kl_loss_coef == settings.grpo.kl_coef == 0.001
    assert grpo.logging.out == str(tmp_path / "grpo") and grpo.rollout.rollout_seed == settings.seed


def test_an_on_policy_phase_without_kl_coef_leaves_the_kl_loss_off(tmp_path):
    settings = AgentDemoSettings(progress_bar=False)
    phase = OnPolicyPhase(recipe="opd", steps=3, prompts_per_step=2, samples_per_prompt=2, lr=1e-2)
    config = demo_run_config(settings, str(tmp_path), "opd", {**phase.run_values(), "teacher_url": "http://teacher"})
    assert config.train.algorithm == "opd" and not config.algorithm.use_kl_loss
    assert "use_kl_loss" not in config.algorithm.given_keys
