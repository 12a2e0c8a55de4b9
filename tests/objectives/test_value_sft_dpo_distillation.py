"""Value loss, SFT cross-entropy, DPO/IPO and the distillation losses."""

import math

import pytest
import torch

from stacx.objectives.distillation import TEACHER_EXECUTED_SENTINEL, union_topk_support
from stacx.objectives.registry import get_loss

from tests.objectives.trajectories import config, random_lengths, random_log_probs, random_masks


def test_clipped_value_loss_matches_formula():
    g = torch.Generator().manual_seed(0)
    lengths = random_lengths(g, 5)
    old = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    values = [(o + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_() for o, n in zip(old, lengths)]
    returns = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = random_masks(g, lengths)
    per_token, metrics = get_loss("value_clipped")(config(value_clip=0.2), values, old, returns, masks)
    clipfrac = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            v, o, r = float(values[i][t]), float(old[i][t]), float(returns[i][t])
            vc = o + min(max(v - o, -0.2), 0.2)
            assert float(per_token[i][t]) == pytest.approx(0.5 * max((v - r) ** 2, (vc - r) ** 2), abs=1e-12)
            clipfrac += float(masks[i][t]) * ((vc - r) ** 2 > (v - r) ** 2)
    assert metrics["vf_clipfrac"].item() == clipfrac and clipfrac > 0
    unclipped, _ = get_loss("value_clipped")(config(value_clip=None), values, old, returns, masks)
    for u, v, r in zip(unclipped, values, returns):
        torch.testing.assert_close(u, 0.5 * (v - r) ** 2)


def test_sft_cross_entropy_is_negative_log_prob_with_gradcheck():
    g = torch.Generator().manual_seed(1)
    lengths = random_lengths(g, 3)
    lp = [x.requires_grad_() for x in random_log_probs(g, lengths)]
    masks = random_masks(g, lengths)
    per_token, metrics = get_loss("sft_cross_entropy")(config(), lp, masks)
    for a, b in zip(per_token, lp):
        torch.testing.assert_close(a, -b)
    assert metrics["nll"].item() == pytest.approx(float(sum((-x * m).sum() for x, m in zip(lp, masks))))
    assert torch.autograd.gradcheck(lambda *x: torch.cat(get_loss("sft_cross_entropy")(None, list(x), masks)[0]),
                                    tuple(x.detach().requires_grad_() for x in lp))


def dpo_inputs(seed=2, pairs=4):
    g = torch.Generator().manual_seed(seed)
    lc, lr = random_lengths(g, pairs), random_lengths(g, pairs)
    return (
        [x.requires_grad_() for x in random_log_probs(g, lc)],
        [x.requires_grad_() for x in random_log_probs(g, lr)],
        random_log_probs(g, lc), random_log_probs(g, lr), random_masks(g, lc), random_masks(g, lr),
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_losses_match_formula_and_gradcheck(loss_type):
    pc, pr, rc, rr, mc, mr = dpo_inputs()
    beta, eps = 0.2, 0.1
    cfg = config(dpo_beta=beta, label_smoothing=eps, dpo_loss_type=loss_type)
    losses, metrics = get_loss(f"dpo_{loss_type}")(cfg, pc, pr, rc, rr, mc, mr)
    same, _ = get_loss("dpo")(cfg, pc, pr, rc, rr, mc, mr)
    torch.testing.assert_close(losses, same)
    accuracy = 0
    for j in range(len(pc)):
        seq = lambda x, m: float((x * m).sum())  # noqa: E731
        h = (seq(pc[j], mc[j]) - seq(rc[j], mc[j])) - (seq(pr[j], mr[j]) - seq(rr[j], mr[j]))
        if loss_type == "sigmoid":
            sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
            expected = -(1 - eps) * math.log(sig(beta * h)) - eps * math.log(sig(-beta * h))
        else:
            expected = (h - 1 / (2 * beta)) ** 2
        assert float(losses[j]) == pytest.approx(expected, abs=1e-12)
        accuracy += h > 0
    assert metrics["reward_accuracy"].item() == accuracy
    assert metrics["dpo_loss"].item() == pytest.approx(float(losses.sum()))

    def fn(*policy):
        return get_loss("dpo")(cfg, list(policy[:4]), list(policy[4:]), rc, rr, mc, mr)[0]

    assert torch.autograd.gradcheck(fn, tuple(x.detach().requires_grad_() for x in pc + pr))


def test_dpo_bad_inputs():
    pc, pr, rc, rr, mc, mr = dpo_inputs()
    with pytest.raises(ValueError, match=r"ref_chosen_log_prob\[1\] has length"):
        bad = list(rc)
        bad[1] = torch.zeros(rc[1].shape[0] + 1)
        get_loss("dpo")(config(), pc, pr, bad, rr, mc, mr)
    with pytest.raises(ValueError, match="dpo_loss_type must be one of"):
        get_loss("dpo")(config(dpo_loss_type="hinge"), pc, pr, rc, rr, mc, mr)
    with pytest.raises(ValueError, match="policy_rejected_log_prob has 3 pairs"):
        get_loss("dpo")(config(), pc, pr[:3], rc, rr[:3], mc, mr[:3])


def distill_batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = random_lengths(g, 5)
    student = [x.requires_grad_() for x in random_log_probs(g, lengths)]
    teacher = random_log_probs(g, lengths)
    return lengths, student, teacher, random_masks(g, lengths)


def test_reverse_kl_k3_on_sampled_token():
    lengths, student, teacher, masks = distill_batch()
    per_token, metrics = get_loss("distill_reverse_kl_k3")(config(), student, teacher, masks)
    for i, n in enumerate(lengths):
        for t in range(n):
            r = float(teacher[i][t] - student[i][t])
            assert float(per_token[i][t]) == pytest.approx(math.exp(r) - 1 - r, abs=1e-12)
    assert all((x >= 0).all() for x in per_token)
    assert torch.autograd.gradcheck(
        lambda *s: torch.cat(get_loss("distill_reverse_kl_k3")(None, list(s), teacher, masks)[0]),
        tuple(x.detach().requires_grad_() for x in student))
    bad = [t.clone() for t in teacher]
    bad[2][0] = TEACHER_EXECUTED_SENTINEL
    with pytest.raises(ValueError, match=r"teacher_log_prob\[2\]\[0\] = 1.0 is not a log-prob"):
        get_loss("distill_reverse_kl_k3")(config(), student, bad, masks)


def test_mixed_dispatch_endpoints_and_metrics():
    lengths, student, teacher, masks = distill_batch(seed=4)
    mixed = get_loss("distill_mixed")
    # all teacher-executed: exactly SFT cross-entropy
    all_teacher = [torch.full((n,), TEACHER_EXECUTED_SENTINEL, dtype=torch.float64) for n in lengths]
    per_token, metrics = mixed(config(), student, all_teacher, masks)
    sft, _ = get_loss("sft_cross_entropy")(config(), student, masks)
    for a, b in zip(per_token, sft):
        torch.testing.assert_close(a, b)
    assert metrics["k3_mean"].item() == 0 and metrics["teacher_action_frac"].item() == float(sum(m.sum() for m in masks))
    assert torch.isfinite(torch.autograd.grad(sum(p.sum() for p in per_token), student)[0]).all()
    # all student-executed: exactly K3
    per_token, metrics = mixed(config(), student, teacher, masks)
    k3, k3_metrics = get_loss("distill_reverse_kl_k3")(config(), student, teacher, masks)
    for a, b in zip(per_token, k3):
        torch.testing.assert_close(a, b)
    assert metrics["ce_mean"].item() == 0 and metrics["teacher_action_frac"].item() == 0
    assert metrics["k3_mean"].item() == pytest.approx(k3_metrics["k3_mean"].item())
    # a real mix: each token follows its own branch
    is_teacher = [torch.arange(n) % 2 == 0 for n in lengths]
    field = [torch.where(w, torch.full_like(t, TEACHER_EXECUTED_SENTINEL), t) for w, t in zip(is_teacher, teacher)]
    per_token, metrics = mixed(config(), student, field, masks)
    ce_sum = k3_sum = frac = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            s, m = float(student[i][t]), float(masks[i][t])
            if is_teacher[i][t]:
                expected = -s
                ce_sum += m * expected
                frac += m
            else:
                r = float(teacher[i][t]) - s
                expected = math.exp(r) - 1 - r
                k3_sum += m * expected
            assert float(per_token[i][t]) == pytest.approx(expected, abs=1e-12)
    assert metrics["ce_mean"].item() == pytest.approx(ce_sum)
    assert metrics["k3_mean"].item() == pytest.approx(k3_sum)
    assert metrics["teacher_action_frac"].item() == frac
    field[1][0] = 0.3
    with pytest.raises(ValueError, match=r"teacher_log_prob\[1\]\[0\] = 0.3 is not a log-prob \(only the \+1.0 sentinel"):
        mixed(config(), student, field, masks)


def test_topk_reverse_kl_equals_exact_kl_on_full_support_and_union_helper():
    g = torch.Generator().manual_seed(5)
    vocab, lengths = 7, [3, 2]
    student_logits = [torch.randn(n, vocab, generator=g, dtype=torch.float64) for n in lengths]
    teacher_logits = [torch.randn(n, vocab, generator=g, dtype=torch.float64) for n in lengths]
    s_lp = [torch.log_softmax(x, -1).requires_grad_() for x in student_logits]
    t_lp = [torch.log_softmax(x, -1) for x in teacher_logits]
    full = [torch.ones(n, vocab, dtype=torch.bool) for n in lengths]
    masks = [torch.ones(n, dtype=torch.float64) for n in lengths]
    per_token, metrics = get_loss("distill_topk_reverse_kl")(config(), s_lp, t_lp, full, masks)
    for i in range(len(lengths)):
        q, p = s_lp[i].exp(), t_lp[i].exp()
        torch.testing.assert_close(per_token[i], (q * (s_lp[i] - p.log())).sum(-1))
    assert metrics["student_support_mass"].item() == pytest.approx(sum(lengths))

    # union of top-2 supports: renormalized KL restricted to the union ids
    s_ids, t_ids = s_lp[0].topk(2, -1).indices, t_lp[0].topk(2, -1).indices
    ids, support = union_topk_support(s_ids, t_ids)
    assert ids.shape == (3, 4) and support[:, :2].all()
    per_token, _ = get_loss("distill_topk_reverse_kl")(
        config(), [s_lp[0].gather(-1, ids)], [t_lp[0].gather(-1, ids)], [support], [masks[0]])
    for t in range(3):
        union = sorted(set(s_ids[t].tolist()) | set(t_ids[t].tolist()))
        assert int(support[t].sum()) == len(union)
        q = torch.softmax(s_lp[0][t, union], -1)
        p = torch.softmax(t_lp[0][t, union], -1)
        assert float(per_token[0][t]) == pytest.approx(float((q * (q.log() - p.log())).sum()), abs=1e-12)
    grad = torch.autograd.grad(per_token[0].sum(), s_lp[0])[0]
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
