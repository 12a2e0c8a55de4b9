"""Models built from configs, diffusers-layout checkpoints, the samplers, rewards and the bad-input errors."""

import pytest
import torch

from stacx.diffusion.checkpoint import load_diffusion_model, save_diffusion_model
from stacx.diffusion.config import DiffusionConfigError, DiffusionModelConfig
from stacx.diffusion.models import DiffusionModel
from stacx.diffusion.prompts import ALL_PROMPTS, VOCABULARY, render_batch
from stacx.diffusion.rewards import get_image_reward
from stacx.diffusion.sampling import group_noise, sample_ode, sample_trajectories, sde_window, step_sigmas, time_grid
from stacx.objectives.diffusion_loss import sde_step_mean

PROMPTS = ["a red square", "a blue circle"]


def tiny(family="mmdit", **overrides):
    label = family == "dit"
    config = DiffusionModelConfig(family=family, conditioner="label" if label else "text", image_size=8,
                                  attention_head_dim=8, vocabulary=ALL_PROMPTS if label else VOCABULARY, **overrides)
    torch.manual_seed(0)
    return DiffusionModel(config)


@pytest.fixture(scope="module")
def mmdit():
    return tiny("mmdit")


@pytest.mark.parametrize("family", ["dit", "mmdit"])
def test_both_families_predict_a_velocity_and_round_trip_through_the_diffusers_layout(family, tmp_path):
    model = tiny(family)
    x = torch.randn(2, 3, 8, 8)
    t = torch.tensor([0.5])
    v = model(x, t, PROMPTS)
    assert v.shape == x.shape and torch.isfinite(v).all()
    path = save_diffusion_model(model, str(tmp_path / "ckpt"))
    import diffusers

    cls = getattr(diffusers, {"dit": "DiTTransformer2DModel", "mmdit": "SD3Transformer2DModel"}[family])
    assert isinstance(cls.from_pretrained(path, subfolder="transformer"), cls)  # diffusers alone loads it
    assert (tmp_path / "ckpt" / "model_index.json").is_file()
    loaded = load_diffusion_model(path)
    assert torch.allclose(loaded(x, t, PROMPTS), v, atol=1e-6)


def test_an_image_size_the_model_cannot_take_is_refused_naming_the_sizes():
    with pytest.raises(DiffusionConfigError, match="image_size 10 is not a multiple of patch_size 4"):
        DiffusionModelConfig(image_size=10, patch_size=4, vocabulary=VOCABULARY)
    model = tiny()
    with pytest.raises(DiffusionConfigError, match=r"takes images of shape \[B, 3, 8, 8\].*got \(1, 3, 16, 16\)"):
        model(torch.randn(1, 3, 16, 16), torch.tensor([0.5]), ["a red square"])


def test_an_unknown_conditioner_is_refused_naming_the_known_ones():
    with pytest.raises(DiffusionConfigError, match="unknown conditioner 'clip'.*known: label, text"):
        DiffusionModelConfig(conditioner="clip", vocabulary=VOCABULARY)
    with pytest.raises(DiffusionConfigError, match="does not fit family 'dit'; use conditioner='label'"):
        DiffusionModelConfig(family="dit", conditioner="text", vocabulary=VOCABULARY)
    with pytest.raises(ValueError, match="not one of its 24 classes"):
        tiny("dit").encode(["a purple hexagon"])


def test_sde_log_prob_is_the_gaussian_density_of_the_sampled_step(mmdit):
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    traj = sample_trajectories(mmdit, PROMPTS, noise, 4, eta=0.8, generator=torch.Generator().manual_seed(2))
    assert traj.latents.shape == (2, 5, 3, 8, 8) and traj.sde_mask.tolist() == [True, True, True, False]
    grid, cond = time_grid(4), mmdit.encode(PROMPTS)
    for k in range(3):
        with torch.no_grad():
            v = mmdit.velocity(traj.latents[:, k], grid[k].float().reshape(1), cond)
        dt = grid[k + 1] - grid[k]
        mean = sde_step_mean(traj.latents[:, k], v, grid[k].float(), dt.float(), traj.sigmas[k].float())
        std = float(traj.sigmas[k] * torch.sqrt(-dt))
        density = torch.distributions.Normal(mean, std).log_prob(traj.latents[:, k + 1]).mean(dim=(1, 2, 3))
        assert torch.allclose(traj.log_probs[:, k], density, atol=1e-4)
        assert abs(float(traj.step_std[k]) - std) < 1e-9
    assert torch.equal(traj.log_probs[:, 3], torch.zeros(2))  # the last step is deterministic


def test_eta_zero_sde_sampler_is_the_ode_sampler(mmdit):
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    traj = sample_trajectories(mmdit, PROMPTS, noise, 4, eta=0.0, generator=torch.Generator().manual_seed(4))
    assert not traj.sde_mask.any()
    ode = sample_ode(mmdit, PROMPTS, noise, 4)
    assert torch.allclose(traj.images, ode, atol=1e-6)
    noisy = sample_trajectories(mmdit, PROMPTS, noise, 4, eta=0.8, generator=torch.Generator().manual_seed(4))
    assert not torch.allclose(noisy.images, ode, atol=1e-3)  # eta > 0 does change the samples


def test_mixgrpo_window_slides_and_only_its_steps_are_stochastic(mmdit):
    windows = [sde_window(step, 6, 2, shift_every=2).nonzero().flatten().tolist() for step in range(10)]
    assert windows[:6] == [[0, 1], [0, 1], [1, 2], [1, 2], [2, 3], [2, 3]]
    assert windows[8] == [0, 1]  # wraps after the last stochastic position [3, 4]
    with pytest.raises(ValueError, match="sde_window_size must be in"):
        sde_window(0, 4, 4)
    noise = torch.randn(2, 3, 8, 8)
    mask = sde_window(2, 4, 1)
    traj = sample_trajectories(mmdit, PROMPTS, noise, 4, eta=0.8, sde_mask=mask, generator=torch.Generator().manual_seed(0))
    assert traj.sde_mask.tolist() == mask.tolist() and (traj.log_probs[:, ~mask] == 0).all()
    assert (traj.log_probs[:, mask] != 0).all()


def test_group_noise_is_shared_within_a_prompt_group_only():
    noise = group_noise(2, 3, (3, 8, 8), torch.Generator().manual_seed(0))
    assert noise.shape == (6, 3, 8, 8)
    assert torch.equal(noise[0], noise[2]) and torch.equal(noise[3], noise[5]) and not torch.equal(noise[0], noise[3])


def test_flow_grpo_sigma_uses_the_second_time_at_t_one():
    sigmas = step_sigmas(time_grid(4), 1.0, "flow_grpo")
    assert torch.allclose(sigmas[:3], torch.tensor([3.0 ** 0.5, 3.0 ** 0.5, 1.0], dtype=torch.float64))
    assert float(sigmas[3]) == 0.0
    with pytest.raises(ValueError, match="sde_sigma_schedule 'ddim' is unknown"):
        step_sigmas(time_grid(4), 1.0, "ddim")


def test_builtin_rewards_score_the_named_colour_and_shape():
    targets = render_batch(["a red square", "a blue circle"], 16)
    for name in ("color", "shape", "color_shape"):
        right = get_image_reward(name)(targets, ["a red square", "a blue circle"])
        wrong = get_image_reward(name)(targets, ["a green triangle", "a yellow triangle"])
        assert torch.allclose(right, torch.ones(2)) and (wrong < 0.8).all()
    with pytest.raises(ValueError, match="unknown image reward 'clip_score'"):
        get_image_reward("clip_score")
    with pytest.raises(ValueError, match="names no colour"):
        get_image_reward("color")(targets[:1], ["a square"])
