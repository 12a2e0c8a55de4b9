"""Every specialization on one process (TP=1, CP=1) against the float64 reference, on random
logits; plus the contract checks: errors naming the field and sample, the reducer mode, the
trainer-loop hooks, metric means, and the distill-mode environment override."""

from __future__ import annotations

import pytest
import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.reduction import Reducer, StepCounts
from stacx.specializations import (
    ActorSpecialization,
    CausalDecoderSpecialization,
    CriticSpecialization,
    DistillSpecialization,
    DPOSpecialization,
    MixedLossDaggerOPDSpecialization,
    pack_micro_batch,
)
from stacx.specializations.distill import resolve_distill_kl_mode
from tests.specializations.cases import (
    CASES,
    VOCAB,
    make_samples,
    reference_config,
    run_case,
)

SINGLE = ProcessGroups.single_process()


def random_logits(samples, seed=3):
    total = sum(len(s) for s in samples["sequences"])
    gen = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(total, VOCAB, generator=gen)).requires_grad_()


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_logits_gradient_match_the_float64_reference(name):
    case, samples = CASES[name], make_samples()
    logits = random_logits(samples)
    result = run_case(lambda tokens, padded: logits * 1.0, SINGLE, case, samples)

    reference_logits = logits.detach().clone().requires_grad_()
    per_sequence = list(reference_logits.split([len(s) for s in samples["sequences"]]))
    expected_loss, expected_metrics = case.reference(per_sequence, samples, reference_config(case))
    expected_loss.backward()

    assert result["loss"] == pytest.approx(float(expected_loss), rel=1e-5, abs=1e-6)
    scale = reference_logits.grad.abs().max()
    torch.testing.assert_close(result["logits_grad"], reference_logits.grad.float(), atol=1e-5 * float(scale), rtol=0)
    for metric, value in expected_metrics.items():
        assert result["metrics"][metric] == pytest.approx(float(value), rel=1e-5, abs=1e-5), metric
    num_tokens = sum(float(m.sum()) for m in samples["loss_masks"])
    assert result["metrics"]["num_loss_tokens"] == num_tokens


def _batch(samples, **fields):
    return pack_micro_batch(samples["sequences"], samples["response_lengths"], **fields)


def _reducer(mode="token-mean"):
    return Reducer(mode=mode, counts=StepCounts(num_tokens=30, num_sequences=6), gradient_average_size=1, norm_length=10.0)


@pytest.mark.parametrize("kl_mode, field, shape_change", [
    ("k3_sample", "teacher_log_probs", "drop_last"),
    ("topk", "teacher_top_log_probs", "drop_last"),
    ("topk", "teacher_top_ids", "other_k"),
])
def test_teacher_fields_of_the_wrong_length_name_the_field_and_sample(kl_mode, field, shape_change):
    samples = make_samples()
    fields = {name: list(samples[name]) for name in ("loss_masks", "teacher_log_probs", "teacher_top_ids",
                                                      "teacher_top_log_probs")}
    bad = fields[field][2]
    fields[field][2] = bad[:-1] if shape_change == "drop_last" else torch.cat([bad, bad[:, :1]], dim=1)
    specialization = DistillSpecialization(AlgorithmConfig.from_values({"distill_kl_mode": kl_mode}))
    with pytest.raises(ValueError, match=rf"'{field}'.*sample 2"):
        specialization.compute_loss(random_logits(samples), _batch(samples, **fields), _reducer())


def test_mixed_dagger_rejects_positive_teacher_log_probs_other_than_the_sentinel():
    samples = make_samples()
    teacher = [t.clone() for t in samples["teacher_log_probs_mixed"]]
    teacher[4][1] = 0.5
    batch = _batch(samples, loss_masks=samples["loss_masks"], teacher_log_probs=teacher)
    with pytest.raises(ValueError, match=r"'teacher_log_probs': sample 4, response token 1.*sentinel"):
        MixedLossDaggerOPDSpecialization().compute_loss(random_logits(samples), batch, _reducer())
    short = [t.clone() for t in samples["teacher_log_probs_mixed"]]
    short[1] = short[1][:-2]
    with pytest.raises(ValueError, match=r"'teacher_log_probs': sample 1"):
        MixedLossDaggerOPDSpecialization().compute_loss(
            random_logits(samples), _batch(samples, loss_masks=samples["loss_masks"], teacher_log_probs=short), _reducer()
        )


def test_contract_errors_name_what_is_wrong():
    samples = make_samples()
    logits = random_logits(samples)
    batch = _batch(samples, loss_masks=samples["loss_masks"])
    with pytest.raises(ValueError, match="mode 'seq-mean-token-sum'.*got 'token-mean'"):
        DPOSpecialization().compute_loss(logits, batch, _reducer("token-mean"))
    with pytest.raises(ValueError, match="'advantages' is missing"):
        ActorSpecialization().compute_loss(logits, batch, _reducer())
    dpo_batch = _batch(samples, loss_masks=samples["loss_masks"], ref_log_probs=samples["ref_log_probs"],
                       pair_ids=[0, 0, 1, 1, 2, 3], is_chosen=samples["is_chosen"])
    with pytest.raises(ValueError, match="pair 2 has only its"):
        DPOSpecialization().compute_loss(logits, dpo_batch, _reducer("seq-mean-token-sum"))
    with pytest.raises(ValueError, match="model_output must be the TP-local logits"):
        CausalDecoderSpecialization().compute_loss(logits[:-1], batch, _reducer())
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        ActorSpecialization(AlgorithmConfig.from_values({"policy_loss": "nope"}))


def test_trainer_loop_hooks():
    config = AlgorithmConfig.from_values(dict(use_kl_loss=True, off_policy_corrections="token_tis,opsm", policy_loss="ppo_clip",
                                recompute_old_log_probs=True, rollout_temperature=0.7, loss_agg_mode="seq-mean-token-mean"))
    actor = ActorSpecialization(config)
    assert actor.needs_reference() and actor.needs_old_log_probs() and actor.needs_whole_sequences()
    assert actor.required_fields() == ("advantages", "ref_log_probs", "rollout_log_probs")
    assert actor.temperature == 0.7 and actor.loss_agg_mode() == "seq-mean-token-mean"
    plain = ActorSpecialization()
    assert not plain.needs_reference() and not plain.needs_old_log_probs() and not plain.needs_whole_sequences()
    assert DPOSpecialization().needs_reference() and DPOSpecialization().loss_agg_mode() == "seq-mean-token-sum"
    assert CriticSpecialization.outputs_values and not ActorSpecialization.outputs_values

    # Advantages are the driver loop's (the registry, by name); the actor only reads them.
    assert not hasattr(ActorSpecialization, "compute_advantages")


def test_compute_log_probs_and_values_return_whole_responses_without_grad():
    samples = make_samples()
    logits = random_logits(samples)
    batch = _batch(samples, loss_masks=samples["loss_masks"])
    log_probs = ActorSpecialization().compute_log_probs(logits, batch)
    per_sequence = logits.detach().split([len(s) for s in samples["sequences"]])
    for lp, seq, lg, r in zip(log_probs, samples["sequences"], per_sequence, samples["response_lengths"]):
        expected = torch.log_softmax(lg[-r - 1 : -1].double(), -1).gather(1, seq[-r:, None])[:, 0]
        torch.testing.assert_close(lp.double(), expected, atol=1e-5, rtol=0)
        assert not lp.requires_grad
    values = CriticSpecialization().compute_values(logits[:, 0] * 1.0, batch)
    assert [v.shape[0] for v in values] == samples["response_lengths"] and not values[0].requires_grad


def test_metric_means_divide_by_their_counts():
    means = MixedLossDaggerOPDSpecialization().metric_means(
        {"ce_mean": 6.0, "k3_mean": 2.0, "teacher_action_frac": 3.0, "num_teacher_tokens": 3.0,
         "num_student_tokens": 5.0, "num_loss_tokens": 8.0, "num_sequences": 2.0}
    )
    assert means == {"ce_mean": 2.0, "k3_mean": 0.4, "teacher_action_frac": 3 / 8, "num_teacher_tokens": 3.0,
                     "num_student_tokens": 5.0, "num_loss_tokens": 8.0, "num_sequences": 2.0}
    assert DPOSpecialization().metric_means({"reward_accuracy": 2.0, "num_pairs": 4.0})["reward_accuracy"] == 0.5


def test_distill_mode_comes_from_the_resolved_config_and_the_environment_only_for_a_bare_one():
    config = AlgorithmConfig.from_values({"distill_kl_mode": "topk"})
    assert resolve_distill_kl_mode(None, environ={}) == "k3_sample"
    assert resolve_distill_kl_mode(config, environ={}) == "topk"
    # The resolved config already carries the override: a worker never re-reads its own environment.
    assert resolve_distill_kl_mode(config, environ={"STACX_DISTILL_KL_MODE": "k3_sample"}) == "topk"
    assert resolve_distill_kl_mode(None, environ={"STACX_DISTILL_KL_MODE": "topk"}) == "topk"
    with pytest.raises(ValueError, match="STACX_DISTILL_KL_MODE"):
        resolve_distill_kl_mode(None, environ={"STACX_DISTILL_KL_MODE": "exact"})
    with pytest.raises(ValueError, match="distill_kl_mode 'exact'"):
        resolve_distill_kl_mode(AlgorithmConfig.from_values({"distill_kl_mode": "exact"}), environ={})


def test_actor_metrics_over_kept_tokens_are_divided_by_the_global_count_with_kept_means_apart():
    """With a correction that masks tokens, entropy and policy metrics are sums over the kept tokens
    divided by the global loss-token count; `<name>_kept_mean` divides them by the kept count."""
    samples = make_samples()
    fields = {name: list(samples[name]) for name in ("loss_masks", "advantages", "log_probs", "rollout_log_probs")}
    config = AlgorithmConfig.from_values({"policy_loss": "vanilla_pg", "off_policy_corrections": "token_mis", "mis_lower": 0.8,
                            "mis_upper": 1.25, "entropy_coef": 0.0, "log_entropy": True})
    actor = ActorSpecialization(config)
    logits = random_logits(samples)
    _, metrics = actor.compute_loss(logits, _batch(samples, **fields), _reducer())
    kept, raw = float(metrics["num_kept_loss_tokens"]), float(metrics["num_loss_tokens"])
    assert 0 < kept < raw  # the correction really masked some tokens

    # Independent: entropy of each response token from the logits, averaged over the kept tokens.
    kept_entropy = []
    offset = 0
    for sequence, response_length, mask, old, rollout in zip(samples["sequences"], samples["response_lengths"],
                                                             fields["loss_masks"], fields["log_probs"],
                                                             fields["rollout_log_probs"]):
        prompt = len(sequence) - response_length
        rows = logits.detach()[offset + prompt - 1: offset + len(sequence) - 1].double()
        entropy = -(rows.softmax(-1) * rows.log_softmax(-1)).sum(-1)
        ratio = torch.exp(old.double() - rollout.double())
        keep = (mask != 0) & (ratio >= 0.8) & (ratio <= 1.25)
        kept_entropy.append(entropy[keep])
        offset += len(sequence)
    expected = torch.cat(kept_entropy)
    assert expected.numel() == kept
    means = actor.metric_means({k: float(v) for k, v in metrics.items()})
    # Guide 000: the metric is the kept sum over the GLOBAL loss-token count; the kept-token mean is separate.
    assert means["entropy"] == pytest.approx(float(expected.sum()) / raw, rel=1e-5)
    assert means["entropy_kept_mean"] == pytest.approx(float(expected.mean()), rel=1e-5)


def test_pi_old_from_the_step_forward_gives_the_loss_and_gradient_of_a_recomputed_pi_old():
    """Why an async run with one optimizer step per rollout spends no forward on pi_old
    (`decoupled_objective_values`): the step's own detached log-probs (no `log_probs` field) give the
    PPO-clip + token_tis loss and gradient that a pi_old recomputed on the same weights gives."""
    import dataclasses

    case, samples = CASES["actor_ppo_kl_entropy_tis"], make_samples()
    logits = random_logits(samples)
    recomputed = ActorSpecialization().compute_log_probs(logits, _batch(samples, loss_masks=samples["loss_masks"]))
    forward = lambda tokens, padded: logits * 1.0  # noqa: E731
    with_recomputed = run_case(forward, SINGLE, case, {**samples, "log_probs": [lp.float() for lp in recomputed]})
    from_the_step = run_case(forward, SINGLE, dataclasses.replace(
        case, fields=tuple(f for f in case.fields if f != "log_probs")), samples)
    assert from_the_step["loss"] == pytest.approx(with_recomputed["loss"], rel=1e-6, abs=1e-7)
    scale = float(with_recomputed["logits_grad"].abs().max())
    torch.testing.assert_close(from_the_step["logits_grad"], with_recomputed["logits_grad"], atol=1e-6 * scale, rtol=0)
    # Not trivial: another pi_old (the samples' own) gives another loss.
    assert run_case(forward, SINGLE, case, samples)["loss"] != pytest.approx(from_the_step["loss"], rel=1e-3)
