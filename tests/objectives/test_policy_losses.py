"""Policy losses against independent float64 formulas, metrics, gradients, bad inputs."""

import math

import pytest
import torch

from stacx.objectives.registry import get_policy_loss

from tests.objectives.trajectories import config, random_lengths, random_log_probs, random_masks


def make_batch(seed, num=6, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    lengths = random_lengths(g, num)
    lengths[0] = 1  # a length-1 response
    old = random_log_probs(g, lengths)
    new = [(o + spread * torch.randn(o.shape, generator=g, dtype=torch.float64)).requires_grad_() for o in old]
    adv = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = random_masks(g, lengths)
    masks[1] = torch.zeros(lengths[1], dtype=torch.float64)  # an all-masked sequence
    return lengths, old, new, adv, masks


def ppo_token(old, new, a, low, high, c):
    rho = math.exp(new - old)
    loss = max(-a * rho, -a * min(max(rho, 1 - low), 1 + high))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def test_ppo_clip_asymmetric_and_dual_clip_match_formula_and_metrics():
    lengths, old, new, adv, masks = make_batch(0, num=10, spread=1.0)
    cfg = config(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=1.5)
    per_token, metrics = get_policy_loss("ppo_clip")(cfg, old, new, adv, masks)
    clip_count = dual_count = kl = pg = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            o, nw, a, m = float(old[i][t]), float(new[i][t]), float(adv[i][t]), float(masks[i][t])
            expected = ppo_token(o, nw, a, 0.1, 0.3, 1.5)
            assert abs(float(per_token[i][t]) - expected) < 1e-12
            rho = math.exp(nw - o)
            clipped_branch = -a * min(max(rho, 0.9), 1.3) > -a * rho
            clip_count += m * clipped_branch
            dual_count += m * (a < 0 and -a * 1.5 < max(-a * rho, -a * min(max(rho, 0.9), 1.3)))
            kl += m * (o - nw)
            pg += m * expected
    assert metrics["pg_clipfrac"].item() == pytest.approx(clip_count)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(dual_count)
    assert metrics["ppo_kl"].item() == pytest.approx(kl)
    assert metrics["pg_loss"].item() == pytest.approx(pg)
    assert clip_count > 0 and dual_count > 0  # the data exercises both branches
    # without dual clip
    per_token, metrics = get_policy_loss("ppo_clip")(config(clip_ratio=0.2), old, new, adv, masks)
    assert "pg_clipfrac_lower" not in metrics
    for i, n in enumerate(lengths):
        for t in range(n):
            expected = ppo_token(float(old[i][t]), float(new[i][t]), float(adv[i][t]), 0.2, 0.2, None)
            assert abs(float(per_token[i][t]) - expected) < 1e-12


def test_gspo_sequence_ratio_value_and_token_gradient():
    lengths, old, new, adv, masks = make_batch(1, spread=0.05)
    cfg = config(clip_ratio_low=0.05, clip_ratio_high=0.08)
    per_token, _ = get_policy_loss("gspo")(cfg, old, new, adv, masks)
    total = sum((l * m).sum() for l, m in zip(per_token, masks))
    total.backward()
    for i, n in enumerate(lengths):
        m = masks[i]
        count = max(float(m.sum()), 1.0)
        s = math.exp(float(((new[i] - old[i]) * m).sum()) / count)
        for t in range(n):
            a = float(adv[i][t])
            clipped = min(max(s, 0.95), 1.08)
            expected = max(-a * s, -a * clipped)
            assert abs(float(per_token[i][t]) - expected) < 1e-12
            # d l_t / d log pi_t = -A s where the unclipped branch is active, else 0
            active = (-a * s) >= (-a * clipped)
            expected_grad = float(m[t]) * (-a * s if active else 0.0)
            assert abs(float(new[i].grad[t]) - expected_grad) < 1e-12


def test_cispo_vanilla_pg_reinforce_values():
    lengths, old, new, adv, masks = make_batch(2, spread=0.5)
    cfg = config(clip_ratio_low=1.0, clip_ratio_high=0.2)  # CISPO: clip from above only
    cispo, cispo_metrics = get_policy_loss("cispo")(cfg, old, new, adv, masks)
    vanilla, _ = get_policy_loss("vanilla_pg")(cfg, old, new, adv, masks)
    reinforce, _ = get_policy_loss("reinforce")(cfg, old, new, adv, masks)
    clipped = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            o, nw, a = float(old[i][t]), float(new[i][t]), float(adv[i][t])
            rho = math.exp(nw - o)
            w = min(rho, 1.2)
            clipped += float(masks[i][t]) * (w != rho)
            assert abs(float(cispo[i][t]) - (-w * a * nw)) < 1e-12
            assert abs(float(vanilla[i][t]) - (-a * rho)) < 1e-12
            assert abs(float(reinforce[i][t]) - (-a * nw)) < 1e-12
    assert cispo_metrics["pg_clipfrac"].item() == pytest.approx(clipped)
    # CISPO's weight is a constant: d l / d log pi = -w A for every token, clipped or not
    grads = torch.autograd.grad(sum(l.sum() for l in cispo), new)
    for i in range(len(lengths)):
        rho = torch.exp(new[i].detach() - old[i])
        torch.testing.assert_close(grads[i], -rho.clamp(max=1.2) * adv[i])


# CISPO and GSPO stop gradients through part of their ratio on purpose, so finite differences
# do not match their autograd gradient; their gradients are checked against formulas above.
@pytest.mark.parametrize("name", ["vanilla_pg", "reinforce", "ppo_clip"])
def test_gradcheck(name):
    lengths, old, new, adv, masks = make_batch(3, num=3, spread=0.02)
    cfg = config(clip_ratio_low=0.3, clip_ratio_high=0.3, clip_ratio_c=3.0)  # away from the clip kinks
    fn = get_policy_loss(name)

    def total(*log_prob):
        per_token, _ = fn(cfg, old, list(log_prob), adv, masks)
        return torch.cat(per_token)

    assert torch.autograd.gradcheck(total, tuple(n.detach().requires_grad_() for n in new))


def test_mismatched_lengths_name_argument_and_trajectory():
    lengths, old, new, adv, masks = make_batch(4)
    bad_adv = list(adv)
    bad_adv[2] = torch.zeros(lengths[2] + 1, dtype=torch.float64)
    for name in ("ppo_clip", "gspo", "cispo", "vanilla_pg", "reinforce"):
        with pytest.raises(ValueError, match=rf"advantages\[2\] has length {lengths[2] + 1} but log_prob\[2\]"):
            get_policy_loss(name)(config(), old, new, bad_adv, masks)
    with pytest.raises(ValueError, match="old_log_prob has 5 trajectories but log_prob has 6"):
        get_policy_loss("ppo_clip")(config(), old[:5], new, adv, masks)
    with pytest.raises(ValueError, match=r"loss_masks\[0\] must be a 1-D tensor"):
        get_policy_loss("ppo_clip")(config(), old, new, adv, [torch.ones(1, 1)] + masks[1:])
    with pytest.raises(ValueError, match="algorithm.clip_ratio_c must be a number > 1"):  # refused by the config
        get_policy_loss("ppo_clip")(config(clip_ratio_c=0.5), old, new, adv, masks)
