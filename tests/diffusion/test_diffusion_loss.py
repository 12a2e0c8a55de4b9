"""Each diffusion kernel against an independent float64 reference of the paper's formula, gradients included."""

import math

import pytest
import torch

from stacx.objectives import diffusion_loss as dl
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import get_loss, get_policy_loss

SHAPE = (3, 4, 4)


def _leaves(n, seed, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(n)]


def _data(n, seed, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n)]


def _config(**values):
    return AlgorithmConfig.from_values(values)


def test_flow_matching_loss_matches_the_velocity_regression_with_its_gradient():
    v, x0, eps = _leaves(3, 0), _data(3, 1), _data(3, 2)
    losses, metrics = get_loss("flow_matching")(None, v, x0, eps)
    total = sum(l.sum() for l in losses)
    total.backward()
    for i in range(3):
        expected = ((v[i].detach() - (eps[i] - x0[i])) ** 2).mean()
        assert torch.allclose(losses[i], expected.reshape(1))
        # d/dv mean((v - u)^2) = 2 (v - u) / numel
        assert torch.allclose(v[i].grad, 2 * (v[i].detach() - (eps[i] - x0[i])) / v[i].numel())
    assert torch.isclose(metrics["fm_loss"], total.detach())


def test_sigma_schedules_follow_flow_grpo_and_dance_grpo():
    t = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    assert torch.allclose(dl.flow_grpo_sigma(t, 0.7), 0.7 * torch.tensor([math.sqrt(1 / 3), 1.0, math.sqrt(3.0)],
                                                                        dtype=torch.float64))
    assert torch.allclose(dl.flow_grpo_sigma(torch.tensor([1.0, 0.5]), 1.0, t_max=0.75),
                          torch.tensor([math.sqrt(3.0), 1.0]))
    with pytest.raises(ValueError, match="t_max"):
        dl.flow_grpo_sigma(torch.tensor([1.0]), 1.0)
    assert torch.equal(dl.dance_grpo_sigma(t, 0.3), torch.full_like(t, 0.3))


def test_sde_step_mean_and_log_prob_match_flow_grpo_and_the_gaussian_density():
    x, v = _data(1, 3)[0], _leaves(1, 4)[0]
    t, dt, sigma = 0.6, -0.2, 0.5
    mean = dl.sde_step_mean(x, v, t, dt, sigma)
    # Flow-GRPO's expanded form: x (1 + s^2 dt / (2t)) + v (1 + s^2 (1 - t) / (2t)) dt
    expected = x * (1 + sigma ** 2 * dt / (2 * t)) + v.detach() * (1 + sigma ** 2 * (1 - t) / (2 * t)) * dt
    assert torch.allclose(mean.detach(), expected)
    std = dl.sde_step_std(torch.tensor(sigma, dtype=torch.float64), torch.tensor(dt, dtype=torch.float64))
    assert math.isclose(float(std), sigma * math.sqrt(0.2))
    x_next = mean.detach() + std * torch.randn(SHAPE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    log_prob = dl.sde_step_log_prob(x_next, mean, std)
    reference = torch.distributions.Normal(mean, std).log_prob(x_next).mean()
    assert torch.allclose(log_prob, reference)
    log_prob.backward()
    # d/dv of mean_elem(-(x' - mu)^2 / 2s^2) with dmu/dv = (1 + s^2 (1 - t) / (2t)) dt
    dmu_dv = (1 + sigma ** 2 * (1 - t) / (2 * t)) * dt
    assert torch.allclose(v.grad, (x_next - mean.detach()) / std ** 2 / x.numel() * dmu_dv)
    assert torch.equal(dl.sde_step_mean(x, v.detach(), t, dt, 0.0), x + v.detach() * dt)  # sigma 0: the ODE step
    with pytest.raises(ValueError, match="std must be > 0"):
        dl.sde_step_log_prob(x_next, mean, torch.tensor(0.0, dtype=torch.float64))


def _clip_reference(old, new, adv, low, high, kl=None, beta=0.0):
    out = []
    for o, n, a in zip(old, new, adv):
        ratio = torch.exp(n - o)
        loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - low, 1 + high))
        out.append(loss)
    if kl is not None:
        out = [l + beta * k for l, k in zip(out, kl)]
    return out


def test_flow_grpo_clip_matches_the_clipped_objective_and_gaussian_kl_with_gradients():
    gen = torch.Generator().manual_seed(6)
    lengths = [3, 2]
    old = [torch.randn(n, generator=gen, dtype=torch.float64) * 0.1 for n in lengths]
    new = [(o + torch.randn(o.shape, generator=gen, dtype=torch.float64) * 0.3).requires_grad_() for o in old]
    adv = [torch.full((n,), a, dtype=torch.float64) for n, a in zip(lengths, (1.5, -0.7))]
    masks = [torch.ones(n, dtype=torch.float64) for n in lengths]
    mean = [torch.randn((n, *SHAPE), generator=gen, dtype=torch.float64).requires_grad_() for n in lengths]
    ref_mean = [m.detach() + 0.1 * torch.randn(m.shape, generator=gen, dtype=torch.float64) for m in mean]
    std = [torch.rand(n, generator=gen, dtype=torch.float64) + 0.2 for n in lengths]
    config = _config(clip_ratio_low=0.1, clip_ratio_high=0.2, use_kl_loss=True, kl_loss_coef=0.04)
    losses, metrics = get_policy_loss("flow_grpo_clip")(config, old, new, adv, masks, mean=mean, ref_mean=ref_mean,
                                                        step_std=std)
    kl = [((m.detach() - r) ** 2).reshape(m.shape[0], -1).mean(1) / (2 * s ** 2) for m, r, s in zip(mean, ref_mean, std)]
    # the Gaussian KL of two steps with the same std, per element, is (mu1 - mu2)^2 / (2 s^2)
    gaussian = torch.distributions.kl_divergence(torch.distributions.Normal(mean[0].detach()[0], std[0][0]),
                                                 torch.distributions.Normal(ref_mean[0][0], std[0][0])).mean()
    assert torch.allclose(kl[0][0], gaussian)
    expected = _clip_reference(old, [n.detach() for n in new], adv, 0.1, 0.2, kl, 0.04)
    for got, want in zip(losses, expected):
        assert torch.allclose(got, want)
    sum(l.sum() for l in losses).backward()
    new_ref = [n.detach().clone().requires_grad_() for n in new]
    mean_ref = [m.detach().clone().requires_grad_() for m in mean]
    kl_ref = [((m - r) ** 2).reshape(m.shape[0], -1).mean(1) / (2 * s ** 2) for m, r, s in zip(mean_ref, ref_mean, std)]
    sum(l.sum() for l in _clip_reference(old, new_ref, adv, 0.1, 0.2, kl_ref, 0.04)).backward()
    for a, b in zip(new + mean, new_ref + mean_ref):
        assert torch.allclose(a.grad, b.grad)
    assert float(metrics["pg_clipfrac"]) > 0  # the clip is active somewhere: the check is not trivial
    with pytest.raises(ValueError, match="ref-load"):
        get_policy_loss("flow_grpo_clip")(config, old, new, adv, masks)


def test_diffusion_dpo_matches_wallace_et_al_with_velocity_errors_and_gradients():
    vw, vl = _leaves(2, 7), _leaves(2, 8)
    rw, rl, uw, ul = _data(2, 9), _data(2, 10), _data(2, 11), _data(2, 12)
    config = _config(diffusion_dpo_beta=50.0)
    losses, metrics = get_loss("diffusion_dpo")(config, vw, vl, rw, rl, uw, ul)
    sum(l.sum() for l in losses).backward()
    for i in range(2):
        vw_i, vl_i = vw[i].detach().clone().requires_grad_(), vl[i].detach().clone().requires_grad_()
        mse = lambda a, b: ((a - b) ** 2).mean()  # noqa: E731
        inside = -0.5 * 50.0 * ((mse(vw_i, uw[i]) - mse(rw[i], uw[i])) - (mse(vl_i, ul[i]) - mse(rl[i], ul[i])))
        expected = -torch.log(torch.sigmoid(inside))
        expected.backward()
        assert torch.allclose(losses[i], expected.detach().reshape(1))
        assert torch.allclose(vw[i].grad, vw_i.grad) and torch.allclose(vl[i].grad, vl_i.grad)
    assert 0 <= float(metrics["dpo_accuracy"]) <= 2


def test_diffusion_dpo_refuses_a_pair_with_mismatched_shapes():
    vw = _leaves(1, 1)
    vl = _leaves(1, 2, shape=(3, 8, 8))
    with pytest.raises(ValueError, match=r"sample 0: velocity_rejected has shape \(3, 8, 8\) but velocity_chosen"):
        get_loss("diffusion_dpo")(_config(), vw, vl, _data(1, 3), _data(1, 4), _data(1, 5), _data(1, 6))


def test_diffusion_nft_matches_the_positive_negative_objective_with_gradients():
    v, v_old, x0, eps = _leaves(3, 13), _data(3, 14), _data(3, 15), _data(3, 16)
    r = [torch.tensor(p, dtype=torch.float64) for p in (0.9, 0.5, 0.1)]
    config = _config(nft_beta=0.7)
    losses, _ = get_loss("diffusion_nft")(config, v, v_old, x0, eps, r)
    sum(l.sum() for l in losses).backward()
    for i in range(3):
        vi = v[i].detach().clone().requires_grad_()
        u = eps[i] - x0[i]
        positive = 0.3 * v_old[i] + 0.7 * vi
        negative = 1.7 * v_old[i] - 0.7 * vi
        expected = r[i] * ((positive - u) ** 2).mean() + (1 - r[i]) * ((negative - u) ** 2).mean()
        expected.backward()
        assert torch.allclose(losses[i], expected.detach().reshape(1))
        assert torch.allclose(v[i].grad, vi.grad)
    assert torch.allclose(dl.nft_optimality(torch.tensor([-5.0, 0.0, 1.0]), 2.0), torch.tensor([0.0, 0.5, 0.75]))


def test_advantage_weighted_matching_weights_the_flow_matching_error_by_the_advantage():
    v, x0, eps = _leaves(2, 17), _data(2, 18), _data(2, 19)
    adv = [torch.tensor(1.3, dtype=torch.float64), torch.tensor(-0.4, dtype=torch.float64)]
    losses, _ = get_loss("advantage_weighted_matching")(None, v, x0, eps, adv)
    sum(l.sum() for l in losses).backward()
    for i in range(2):
        u = eps[i] - x0[i]
        assert torch.allclose(losses[i], (adv[i] * ((v[i].detach() - u) ** 2).mean()).reshape(1))
        assert torch.allclose(v[i].grad, adv[i] * 2 * (v[i].detach() - u) / u.numel())
