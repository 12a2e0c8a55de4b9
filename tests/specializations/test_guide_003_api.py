"""Guide 003's specialization API (issue 13, item 6) and kernel traits (item 5), in one process.
The CP=2 / DP=2 invariance of the same pieces is in test_split_invariance.py (families
`guide_003_my_algo` and `actor_custom_sequence_loss`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives import sum_of_sample_mean
from stacx.objectives.registry import POLICY_LOSSES, get_off_policy_correction_traits, get_policy_loss_traits, register_policy_loss
from stacx.parallel.reduction import Reducer, StepCounts
from stacx.specializations import ActorSpecialization, CausalDecoderSpecialization
from stacx.specializations.batch import pack_micro_batch


def test_sum_of_sample_mean_is_the_sum_of_each_samples_masked_mean():
    per_token = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 5.0])
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0])]
    # (1 + 2) / 2 + 20 / 1 + 0 (no loss token: contributes nothing)
    assert float(sum_of_sample_mean(per_token, [3, 2, 1], masks)) == pytest.approx(21.5)
    with pytest.raises(ValueError, match=r"per_token must be \[N_response = sum\(response_lengths\) = 5\]"):
        sum_of_sample_mean(per_token, [3, 2], masks[:2])
    with pytest.raises(ValueError, match=r"loss_masks\[1\] has shape"):
        sum_of_sample_mean(per_token, [3, 2, 1], [masks[0], torch.ones(3), masks[2]])


def test_reducer_of_a_scalar_divides_by_the_global_sample_count_and_undoes_averaging():
    counts = StepCounts(num_tokens=40, num_sequences=8)
    scalar = torch.tensor(6.0)
    plain = Reducer(mode="token-mean", counts=counts, gradient_average_size=2)
    assert float(plain(scalar)) == pytest.approx(2 * 6.0 / 8)
    # Under CP the scalar comes from whole responses replicated on every CP rank: each carries 1/cp.
    cp2 = Reducer(mode="token-mean", counts=counts, gradient_average_size=4, cp_size=2)
    assert float(cp2(scalar)) == pytest.approx(4 * 6.0 / 8 / 2)
    assert float(cp2(scalar, replicated_across_cp=False)) == pytest.approx(4 * 6.0 / 8)
    assert plain.loss_value(plain(scalar)) == pytest.approx(6.0 / 8)
    with pytest.raises(ValueError, match="reducer\\(scalar\\) takes no loss_masks"):
        plain(scalar, [torch.ones(2)])
    with pytest.raises(ValueError, match="loss_masks is required"):
        plain([torch.ones(2)])


def test_batch_has_response_lengths_and_response_log_probs_are_whole_responses_concatenated():
    torch.manual_seed(0)
    sequences = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    batch = pack_micro_batch(sequences, [2, 1], loss_masks=[torch.ones(2), torch.ones(1)])
    assert batch["response_lengths"] == [2, 1]
    logits = torch.randn(7, 11, requires_grad=True)
    log_probs = CausalDecoderSpecialization().response_log_probs(logits, batch)
    full = torch.log_softmax(logits, -1)
    # response token j of sequence i is predicted at position prompt_i - 1 + j of the packed row
    expected = torch.stack([full[1, 3], full[2, 4], full[5, 7]])
    torch.testing.assert_close(log_probs, expected)
    log_probs.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_builtin_traits_are_declared_at_registration_and_a_custom_loss_defaults_to_whole_sequences():
    assert get_policy_loss_traits("ppo_clip").token_local and not get_policy_loss_traits("gspo").token_local
    assert get_off_policy_correction_traits("token_tis").token_local
    assert not get_off_policy_correction_traits("sequence_mis").token_local
    assert get_off_policy_correction_traits("opsm").uses_current_policy
    assert not get_off_policy_correction_traits("token_tis").uses_current_policy
    loss = lambda config, old, new, adv, masks, **kw: ([-a * n for a, n in zip(adv, new)], {})  # noqa: E731
    register_policy_loss("traits_default_test")(loss)
    register_policy_loss("traits_local_test", token_local=True)(loss)
    try:
        config = AlgorithmConfig(policy_loss="traits_default_test", log_entropy=False)
        assert ActorSpecialization(config).needs_whole_sequences()
        config = dataclasses.replace(config, policy_loss="traits_local_test")
        assert not ActorSpecialization(config).needs_whole_sequences()
        config = dataclasses.replace(config, off_policy_corrections="token_tis,sequence_mis")
        assert ActorSpecialization(config).needs_whole_sequences()
    finally:
        POLICY_LOSSES.unregister("traits_default_test")
        POLICY_LOSSES.unregister("traits_local_test")


def test_a_metric_without_a_count_is_logged_as_the_reducer_output_not_zero():
    from stacx.trainer.runtime.role_runtime import normalize_uncounted_metrics

    reducer = Reducer(mode="token-mean", counts=StepCounts(num_tokens=10, num_sequences=4), gradient_average_size=4)
    spec = CausalDecoderSpecialization()
    uncounted: set[str] = set()
    sums = normalize_uncounted_metrics({"my_loss": torch.tensor(8.0)}, spec, reducer, uncounted)
    assert uncounted == {"my_loss"} and float(sums["my_loss"]) == pytest.approx(2.0)
    counted = {"nll": torch.tensor(8.0), "num_loss_tokens": torch.tensor(4.0)}
    assert normalize_uncounted_metrics(dict(counted), spec, reducer, set()) == counted


def test_a_plugin_metric_named_like_a_step_metric_is_kept_beside_the_frameworks():
    """A plugin's `loss` metric was overwritten by the framework's total; it is now logged as `loss_plugin`, its
    declared denominator still dividing it, and the framework's `loss` keeps its name."""
    from stacx.trainer.runtime.role_runtime import LOSS_METRIC, normalize_uncounted_metrics, set_aside_step_metric_names

    reducer = Reducer(mode="token-mean", counts=StepCounts(num_tokens=10, num_sequences=4), gradient_average_size=4)
    uncounted: set[str] = set()
    sums = normalize_uncounted_metrics({"loss": torch.tensor(8.0), "lr": torch.tensor(4.0)},
                                       CausalDecoderSpecialization(), reducer, uncounted)
    sums = set_aside_step_metric_names(sums, uncounted)
    sums[LOSS_METRIC] = torch.tensor(1.0)  # what the runtime writes next: the framework's total
    assert uncounted == {"loss_plugin", "lr_plugin"}
    assert float(sums["loss_plugin"]) == pytest.approx(2.0) and float(sums["lr_plugin"]) == pytest.approx(1.0)
    assert float(sums["loss"]) == 1.0

    class Declared(CausalDecoderSpecialization):
        metric_denominators = {"grad_norm": "num_sequences"}

    counted = set_aside_step_metric_names({"grad_norm": 8.0, "num_sequences": 4.0, "num_loss_tokens": 2.0}, set())
    assert Declared().metric_means(counted) == {"grad_norm_plugin": 2.0, "num_sequences": 4.0, "num_loss_tokens": 2.0}


def test_the_documents_module_names_find_the_specializations():
    """Design document 003 names the policy-gradient specialization `specialization/agent.py`; Stacx keeps it in
    `specializations/actor.py` and answers to both names (the other three share the document's names)."""
    from stacx.specializations import agent, causal_decoder, distill, mixed_loss_dagger

    assert agent.ActorSpecialization is ActorSpecialization
    assert causal_decoder.CausalDecoderSpecialization is CausalDecoderSpecialization
    assert distill.DistillSpecialization and mixed_loss_dagger.MixedLossDaggerOPDSpecialization
