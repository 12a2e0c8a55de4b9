"""MixedLossDaggerOPDSpecialization at its two endpoints, exactly, and in between.

- every token teacher-executed (+1.0 sentinel everywhere): the loss and its gradient are
  bit-for-bit those of CausalDecoderSpecialization (SFT cross-entropy on the teacher's actions);
- every token student-executed: bit-for-bit those of DistillSpecialization in k3_sample mode;
- a mixture: CE on the teacher tokens plus K3 on the student ones, and the logged means
  ce_mean, k3_mean, teacher_action_frac.
"""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.reduction import Reducer, StepCounts
from stacx.specializations import (
    CausalDecoderSpecialization,
    DistillSpecialization,
    MixedLossDaggerOPDSpecialization,
    pack_micro_batch,
)

VOCAB = 37
PROMPTS, RESPONSES = [2, 4, 3], [5, 3, 6]


def micro_batch(teacher_log_probs):
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, VOCAB, (p + r,), generator=gen) for p, r in zip(PROMPTS, RESPONSES)]
    masks = [(torch.rand(r, generator=gen) > 0.2).float() for r in RESPONSES]
    return pack_micro_batch(sequences, RESPONSES, loss_masks=masks, teacher_log_probs=teacher_log_probs)


def real_teacher_log_probs():
    gen = torch.Generator().manual_seed(6)
    return [-0.2 - 4.0 * torch.rand(r, generator=gen) for r in RESPONSES]


def loss_and_gradient(specialization, batch):
    total = sum(len(s) for s in batch["tokens"].split(batch["layout"].lengths))
    logits = (1.5 * torch.randn(total, VOCAB, generator=torch.Generator().manual_seed(7))).requires_grad_()
    counts = StepCounts(num_tokens=int(sum(m.sum() for m in batch["loss_masks"])), num_sequences=len(RESPONSES))
    reducer = Reducer(mode="token-mean", counts=counts, gradient_average_size=1)
    loss, metrics = specialization.compute_loss(logits, batch, reducer)
    loss.backward()
    return loss.detach(), logits.grad, metrics


def test_all_teacher_executed_is_exactly_the_cross_entropy_loss():
    sentinels = [torch.ones(r) for r in RESPONSES]
    mixed_loss, mixed_grad, metrics = loss_and_gradient(MixedLossDaggerOPDSpecialization(), micro_batch(sentinels))
    ce_loss, ce_grad, ce_metrics = loss_and_gradient(CausalDecoderSpecialization(), micro_batch(sentinels))
    assert torch.equal(mixed_loss, ce_loss)
    assert torch.equal(mixed_grad, ce_grad)
    assert float(metrics["ce_mean"]) == float(ce_metrics["nll"])
    means = MixedLossDaggerOPDSpecialization().metric_means({k: float(v) for k, v in metrics.items()})
    assert means["teacher_action_frac"] == 1.0 and means["k3_mean"] == 0.0


def test_all_student_executed_is_exactly_the_k3_distillation_loss():
    teacher = real_teacher_log_probs()
    mixed_loss, mixed_grad, metrics = loss_and_gradient(MixedLossDaggerOPDSpecialization(), micro_batch(teacher))
    k3_loss, k3_grad, k3_metrics = loss_and_gradient(DistillSpecialization(), micro_batch(teacher))
    assert torch.equal(mixed_loss, k3_loss)
    assert torch.equal(mixed_grad, k3_grad)
    assert float(metrics["k3_mean"]) == float(k3_metrics["k3_mean"])
    means = MixedLossDaggerOPDSpecialization().metric_means({k: float(v) for k, v in metrics.items()})
    assert means["teacher_action_frac"] == 0.0 and means["ce_mean"] == 0.0


def test_a_mixture_is_cross_entropy_on_teacher_tokens_plus_k3_on_student_tokens():
    teacher = real_teacher_log_probs()
    executed_by_teacher = [torch.rand(r, generator=torch.Generator().manual_seed(8 + i)) < 0.5
                           for i, r in enumerate(RESPONSES)]
    mixed = [torch.where(t, torch.tensor(1.0), u) for t, u in zip(executed_by_teacher, teacher)]
    loss, _, metrics = loss_and_gradient(MixedLossDaggerOPDSpecialization(), micro_batch(mixed))

    batch = micro_batch(mixed)
    total = sum(batch["layout"].lengths)
    logits = 1.5 * torch.randn(total, VOCAB, generator=torch.Generator().manual_seed(7))
    ce_sum = k3_sum = 0.0
    teacher_tokens = 0.0
    for seq, lg, r, t, u, m in zip(batch["tokens"].split(batch["layout"].lengths), logits.split(batch["layout"].lengths),
                                   RESPONSES, executed_by_teacher, teacher, batch["loss_masks"]):
        lp = torch.log_softmax(lg[-r - 1 : -1].double(), -1).gather(1, seq[-r:, None])[:, 0]
        d = u.double() - lp
        ce_sum += float((-lp * t * m).sum())
        k3_sum += float(((torch.exp(d) - 1 - d) * ~t * m).sum())
        teacher_tokens += float((t * m).sum())
    num_tokens = float(sum(m.sum() for m in batch["loss_masks"]))
    assert float(loss) == pytest.approx((ce_sum + k3_sum) / num_tokens, rel=1e-5)
    means = MixedLossDaggerOPDSpecialization().metric_means({k: float(v) for k, v in metrics.items()})
    assert 0 < teacher_tokens < num_tokens
    assert means["teacher_action_frac"] == pytest.approx(teacher_tokens / num_tokens)
    assert means["ce_mean"] == pytest.approx(ce_sum / teacher_tokens, rel=1e-5)
    assert means["k3_mean"] == pytest.approx(k3_sum / (num_tokens - teacher_tokens), rel=1e-5)
