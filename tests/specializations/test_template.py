"""The template-method `Specialization` and its `MicroBatch`, in one process: a subclass that writes
only `per_token_terms` gets the checks, the reduction and the counts; code written to the first API
(overriding `compute_loss`, fields read by name) still runs or gets an error naming the new name;
entropy is computed only when it carries a coefficient or is logged (issue 16)."""

from __future__ import annotations

import pytest
import torch

import stacx.specializations.base as base
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives import sum_of_sample_mean
from stacx.parallel.reduction import Reducer, StepCounts
from stacx.specializations import ActorSpecialization, CausalDecoderSpecialization, MicroBatch
from stacx.specializations.base import LossTerms, Specialization, masked_total

SEQUENCES = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8]), torch.tensor([2, 9, 4, 1])]
RESPONSES = [3, 1, 2]
MASKS = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0]), torch.tensor([1.0, 1.0])]
VOCAB = 11


def _logits(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(len(s) for s in SEQUENCES), VOCAB, generator=gen).requires_grad_()


def _reducer(mode="token-mean"):
    counts = StepCounts(num_tokens=int(sum(m.sum() for m in MASKS)), num_sequences=len(MASKS))
    return Reducer(mode=mode, counts=counts, gradient_average_size=1)


def _response_log_probs(logits):
    """log pi of each response token, from the float64 log-softmax of the packed logits."""
    rows, offset = [], 0
    for sequence, response in zip(SEQUENCES, RESPONSES):
        full = torch.log_softmax(logits[offset: offset + len(sequence)].double(), -1)
        prompt = len(sequence) - response
        rows.append(full[prompt - 1: len(sequence) - 1].gather(1, sequence[prompt:, None])[:, 0])
        offset += len(sequence)
    return rows


class ScaledNLL(Specialization):
    """A subclass written to the template: per-token terms only."""

    def per_token_terms(self, view, batch):
        per_token = [-2.0 * lp for lp in view.values]
        return LossTerms(per_token, {"scaled_nll": masked_total(per_token, view.loss_masks)})


def test_a_subclass_writing_only_per_token_terms_gets_the_reduction_and_the_counts():
    batch = MicroBatch.pack(SEQUENCES, RESPONSES, loss_masks=MASKS)
    logits = _logits()
    loss, metrics = ScaledNLL().compute_loss(logits, batch, _reducer())
    expected = sum((-2.0 * lp * m.double()).sum() for lp, m in zip(_response_log_probs(logits), MASKS)) / 5
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(metrics["num_loss_tokens"]) == 5 and float(metrics["num_sequences"]) == 3
    assert float(metrics["scaled_nll"]) == pytest.approx(float(expected) * 5, rel=1e-6)
    loss.backward()
    assert logits.grad.abs().sum() > 0
    # The base class owns the checks: a field sized unlike its response names the field and sample.
    bad = MicroBatch.pack(SEQUENCES, RESPONSES, loss_masks=MASKS, advantages=[torch.zeros(3), torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match=r"batch field 'advantages': sample 1 has shape \(2,\)"):
        ScaledNLL().compute_loss(_logits(), bad, _reducer())
    with pytest.raises(ValueError, match="needs a Reducer with mode 'token-mean'"):
        ScaledNLL().compute_loss(_logits(), batch, _reducer("seq-mean-token-mean"))
    with pytest.raises(TypeError, match="takes a MicroBatch"):
        ScaledNLL().compute_loss(_logits(), {"loss_masks": MASKS}, _reducer())
    with pytest.raises(TypeError, match="needs a stacx.parallel.reduction.Reducer"):
        ScaledNLL().compute_loss(_logits(), batch, lambda *a, **k: None)


class GuideAsWritten(CausalDecoderSpecialization):
    """Guide 003's form, written before the template: compute_loss overridden, fields read by name."""

    def compute_loss(self, model_output, batch, reducer):
        response_lengths = batch["response_lengths"]
        loss_masks = batch["loss_masks"]
        log_probs = self.response_log_probs(model_output, batch)
        loss = reducer(sum_of_sample_mean(-log_probs, response_lengths, loss_masks))
        return loss, {"my_loss": loss.detach()}


def test_code_written_to_the_first_api_still_runs_and_renamed_fields_name_their_new_name():
    batch = MicroBatch.pack(SEQUENCES, RESPONSES, loss_masks=MASKS)
    logits = _logits(1)
    loss, _ = GuideAsWritten().compute_loss(logits, batch, _reducer())
    per_sample = [(-lp * m.double()).sum() / m.sum() for lp, m in zip(_response_log_probs(logits), MASKS)]
    assert float(loss) == pytest.approx(float(sum(per_sample)) / 3, rel=1e-6)
    assert batch["response_lengths"] == RESPONSES and batch.get("advantages") is None and "loss_masks" in batch
    with pytest.raises(KeyError, match="'old_log_probs' is now 'log_probs'"):
        batch.get("old_log_probs")
    with pytest.raises(KeyError, match="'group_indices' is now 'prompt_id'"):
        "group_indices" in batch  # noqa: B015 - a silent False would skip the field
    with pytest.raises(ValueError, match=r"unknown fields \['group_indices'\] \(renamed: group_indices -> prompt_id\)"):
        MicroBatch.pack(SEQUENCES, RESPONSES, loss_masks=MASKS, group_indices=[0, 0, 1])
    with pytest.raises(KeyError, match="has no field 'bogus'"):
        batch.set_field("bogus", [])


@pytest.mark.parametrize("entropy_coef, log_entropy, computed, with_grad", [
    (0.0, False, False, False),
    (0.0, True, True, False),
    (0.01, False, True, True),
])
def test_actor_computes_entropy_only_when_it_has_a_coefficient_or_is_logged(
        monkeypatch, entropy_coef, log_entropy, computed, with_grad):
    calls = []
    kernel = base.vocab_parallel_log_probs_and_entropy

    def recording(*args, **kwargs):
        calls.append((kwargs["with_entropy"], kwargs["entropy_requires_grad"]))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(base, "vocab_parallel_log_probs_and_entropy", recording)
    config = AlgorithmConfig.from_values({"policy_loss": "ppo_clip", "entropy_coef": entropy_coef, "log_entropy": log_entropy})
    batch = MicroBatch.pack(SEQUENCES, RESPONSES, loss_masks=MASKS, advantages=[torch.ones(r) for r in RESPONSES])
    _, metrics = ActorSpecialization(config).compute_loss(_logits(2), batch, _reducer())
    assert calls == [(computed, with_grad)]
    assert ("entropy" in metrics) == computed
