"""KL estimators, the KL/entropy terms, and the off-policy corrections."""

import math

import pytest
import torch

from stacx.objectives.kl import add_kl_and_entropy_terms
from stacx.objectives.off_policy import apply_off_policy_corrections, m2po_keep_mask
from stacx.objectives.registry import get_kl_estimator, get_off_policy_correction

from tests.objectives.trajectories import config, random_lengths, random_log_probs, random_masks


def test_kl_estimators_match_formulas_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(20, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(20, generator=g, dtype=torch.float64) * 3
    for i in range(20):
        d = float(lp[i] - ref[i])
        assert float(get_kl_estimator("k1")(lp, ref)[i]) == pytest.approx(d, abs=1e-12)
        assert float(get_kl_estimator("k2")(lp, ref)[i]) == pytest.approx(0.5 * d * d, abs=1e-12)
        assert float(get_kl_estimator("k3")(lp, ref)[i]) == pytest.approx(math.exp(-d) - 1 + d, abs=1e-12)
    assert (get_kl_estimator("low_var_kl")(lp, ref) >= 0).all()
    # clamped: a huge log-ratio cannot produce inf
    extreme = get_kl_estimator("k3")(torch.tensor([-100.0, 100.0]), torch.tensor([0.0, 0.0]))
    assert torch.isfinite(extreme).all() and extreme.max().item() <= 10.0
    for name in ("k1", "k2", "k3"):
        fn = get_kl_estimator(name)
        assert torch.autograd.gradcheck(lambda x: fn(x, ref), (lp.clone().requires_grad_(),))
    with pytest.raises(ValueError, match="ref_log_prob shape"):
        get_kl_estimator("k1")(lp, ref[:3])


def test_kl_loss_and_entropy_terms_added_per_token():
    g = torch.Generator().manual_seed(1)
    lengths = random_lengths(g, 4)
    lp, ref = random_log_probs(g, lengths), random_log_probs(g, lengths)
    entropy = [torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = random_masks(g, lengths)
    base = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    cfg = config(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k2", entropy_coef=0.01)
    total, metrics = add_kl_and_entropy_terms(cfg, base, lp, masks, ref_log_prob=ref, entropy=entropy)
    for i in range(len(lengths)):
        expected = base[i] + 0.3 * 0.5 * (lp[i] - ref[i]) ** 2 - 0.01 * entropy[i]
        torch.testing.assert_close(total[i], expected)
    assert metrics["kl_loss"].item() == pytest.approx(sum(float((0.5 * (a - b) ** 2 * m).sum()) for a, b, m in zip(lp, ref, masks)))
    assert metrics["entropy"].item() == pytest.approx(sum(float((h * m).sum()) for h, m in zip(entropy, masks)))
    with pytest.raises(ValueError, match="use_kl_loss is set but ref_log_prob"):
        add_kl_and_entropy_terms(cfg, base, lp, masks)
    with pytest.raises(ValueError, match="entropy_coef is 0.01 but entropy"):
        add_kl_and_entropy_terms(config(entropy_coef=0.01), base, lp, masks)


def off_policy_batch(seed=2, num=8, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    lengths = random_lengths(g, num)
    rollout = random_log_probs(g, lengths)
    train = [r + spread * torch.randn(r.shape, generator=g, dtype=torch.float64) for r in rollout]
    masks = random_masks(g, lengths)
    return lengths, train, rollout, masks


def test_truncated_and_masked_importance_sampling_token_and_sequence():
    lengths, train, rollout, masks = off_policy_batch()
    cfg = config(tis_threshold=1.5, mis_lower=0.6, mis_upper=1.4)
    token_tis = get_off_policy_correction("token_tis")(cfg, train, rollout, masks)
    seq_tis = get_off_policy_correction("sequence_tis")(cfg, train, rollout, masks)
    token_mis = get_off_policy_correction("token_mis")(cfg, train, rollout, masks)
    seq_mis = get_off_policy_correction("sequence_mis")(cfg, train, rollout, masks)
    clipped = masked_tokens = 0.0
    for i, n in enumerate(lengths):
        seq_ratio = math.exp(sum(float(train[i][t] - rollout[i][t]) * float(masks[i][t]) for t in range(n)))
        seq_keep = 0.6 <= seq_ratio <= 1.4
        for t in range(n):
            ratio = math.exp(float(train[i][t] - rollout[i][t]))
            m = float(masks[i][t])
            assert float(token_tis.weights[i][t]) == pytest.approx(min(ratio, 1.5), rel=1e-6)
            assert float(seq_tis.weights[i][t]) == pytest.approx(min(seq_ratio, 1.5), rel=1e-6)
            keep = 0.6 <= ratio <= 1.4
            assert float(token_mis.loss_masks[i][t]) == m * keep
            assert float(token_mis.weights[i][t]) == pytest.approx(ratio * keep, rel=1e-6)
            assert float(seq_mis.loss_masks[i][t]) == m * seq_keep
            clipped += m * (ratio > 1.5)
            masked_tokens += m * (not keep)
        assert torch.equal(token_tis.loss_masks[i], masks[i])
    assert token_tis.metrics["token_tis_clipped"].item() == clipped and clipped > 0
    assert token_mis.metrics["token_mis_masked"].item() == masked_tokens and masked_tokens > 0
    flat_delta = torch.cat(train) - torch.cat(rollout)
    flat_mask = torch.cat(masks)
    assert token_tis.metrics["mismatch_k1"].item() == pytest.approx(float((-flat_delta * flat_mask).sum()))
    k3 = torch.exp(flat_delta) - 1 - flat_delta
    assert token_tis.metrics["mismatch_k3"].item() == pytest.approx(float((k3 * flat_mask).sum()))
    assert token_tis.metrics["mismatch_abs_log_ratio"].item() == pytest.approx(float((flat_delta.abs() * flat_mask).sum()))


def test_opsm_masks_negative_advantage_sequences_that_drifted():
    lengths = [3, 3, 3, 2]
    rollout = [torch.full((n,), -1.0, dtype=torch.float64) for n in lengths]
    # mean KL (rollout - train): seq0 0.5 (A<0 -> masked), seq1 0.5 (A>0 kept), seq2 ~0 (kept),
    # seq3 0.5 but its only loss token... all masked (nothing to mask)
    train = [rollout[0] - 0.5, rollout[1] - 0.5, rollout[2] - 1e-6, rollout[3] - 0.5]
    advantages = [torch.full((n,), a, dtype=torch.float64) for n, a in zip(lengths, [-1.0, 1.0, -1.0, -1.0])]
    masks = [torch.ones(3), torch.ones(3), torch.ones(3), torch.zeros(2)]
    out = get_off_policy_correction("opsm")(config(opsm_delta=0.1), train, rollout, masks, advantages=advantages)
    assert [m.tolist() for m in out.loss_masks] == [[0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0]]
    assert out.weights is None and out.metrics["opsm_masked"].item() == 3


def brute_force_m2po(sq, threshold):
    """Smallest set of largest values to drop so the remaining mean is <= threshold."""
    n = len(sq)
    order = sorted(range(n), key=lambda i: -sq[i])
    for k in range(n + 1):
        rest = [sq[i] for i in order[k:]]
        if not rest or sum(rest) / len(rest) <= threshold:
            return set(order[:k])


def test_m2po_drops_fewest_largest_tokens_to_bound_second_moment():
    for seed in range(5):
        lengths, train, rollout, masks = off_policy_batch(seed=seed, spread=0.3)
        out = get_off_policy_correction("m2po")(config(m2po_threshold=0.04), train, rollout, masks)
        delta = (torch.cat(train) - torch.cat(rollout))
        flat_mask = torch.cat(masks)
        active = [i for i in range(len(delta)) if flat_mask[i] > 0]
        sq = [float(delta[i]) ** 2 for i in active]
        dropped = brute_force_m2po(sq, 0.04)
        kept = torch.cat(out.loss_masks)
        assert {j for j, i in enumerate(active) if kept[i] == 0} == dropped
        assert all(kept[i] == 0 for i in range(len(delta)) if flat_mask[i] == 0)
        remaining = [s for j, s in enumerate(sq) if j not in dropped]
        assert sum(remaining) / max(len(remaining), 1) <= 0.04 + 1e-12
        assert out.metrics["m2po_masked"].item() == len(dropped)
    assert m2po_keep_mask(torch.tensor([0.01, 0.02]), 0.04).all()
    assert m2po_keep_mask(torch.zeros(0), 0.04).numel() == 0


def test_corrections_compose_masks_and_weights():
    lengths, train, rollout, masks = off_policy_batch(seed=6)
    cfg = config(tis_threshold=2.0, m2po_threshold=0.05)
    combined = apply_off_policy_corrections(cfg, ["token_tis", "m2po"], train, rollout, masks)
    tis = get_off_policy_correction("token_tis")(cfg, train, rollout, masks)
    m2po = get_off_policy_correction("m2po")(cfg, train, rollout, masks)
    for a, b in zip(combined.loss_masks, m2po.loss_masks):
        assert torch.equal(a, b)
    for a, b in zip(combined.weights, tis.weights):
        assert torch.equal(a, b)
    assert {"mismatch_k1", "token_tis_clipped", "m2po_masked"} <= set(combined.metrics)


def test_off_policy_bad_inputs():
    lengths, train, rollout, masks = off_policy_batch()
    with pytest.raises(ValueError, match=r"rollout_log_prob\[0\] has length"):
        get_off_policy_correction("token_tis")(config(), train, [torch.zeros(lengths[0] + 1)] + rollout[1:], masks)
    with pytest.raises(ValueError, match="mis_lower < mis_upper"):
        get_off_policy_correction("token_mis")(config(mis_lower=2.0, mis_upper=1.0), train, rollout, masks)
    with pytest.raises(TypeError, match="advantages"):
        get_off_policy_correction("opsm")(config(), train, rollout, masks)
