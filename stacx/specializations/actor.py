"""Policy-gradient actor (GRPO, Dr. GRPO, GSPO, DAPO, CISPO, REINFORCE++, RLOO, PPO's actor).

Per response token, with log pi from this micro-batch's forward and pi_old, pi_ref, pi_rollout
from batch fields:

    l_t = w_t * policy_loss(log pi_t, log pi_old_t, A_t)          (registry: config.policy_loss)
          + kl_loss_coef * KL_est(log pi_t, log pi_ref_t)          (config.use_kl_loss, kl_loss_type)
          - entropy_coef * H_t                                     (config.entropy_coef)

masked by the loss masks after the off-policy corrections (config.off_policy_corrections,
a list of registry names), w_t their importance weights (1 without), and reduced by the
reducer with config.loss_agg_mode. Advantages come from the advantage registry
(config.advantage_estimator), computed by the driver's loop before training.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from stacx.objectives.aggregation import loss_token_counts
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.kl import add_kl_and_entropy_terms
from stacx.objectives.off_policy import mismatch_metrics
from stacx.objectives.registry import (
    get_kl_estimator,
    get_off_policy_correction,
    get_off_policy_correction_traits,
    get_policy_loss,
    get_policy_loss_traits,
)
from stacx.specializations.base import LossTerms, Specialization, _overrides_below

NUM_KEPT_LOSS_TOKENS = "num_kept_loss_tokens"
"""Loss tokens left after the off-policy corrections masked some: the count the separate
`<metric>_kept_mean` metrics are divided by. The metrics themselves (sums over the kept tokens,
0 on dropped ones) are divided by the global loss-token count, as every other metric."""
KEPT_MEAN_SUFFIX = "_kept_mean"
FRAMEWORK_METRIC_SUFFIX = "_framework"
"""A framework metric (`entropy`, `kl_loss`, the mismatch metrics) whose name a plugin kernel's own
metric already uses is logged as `<name>_framework`: the plugin's value keeps its name, never replaced."""


def merge_kernel_and_framework_metrics(kernel_metrics: dict[str, torch.Tensor],
                                       framework_metrics: dict[str, torch.Tensor]) -> tuple[dict, dict[str, str]]:
    """(both merged, framework name -> the name it is logged under). A kernel's (plugin's) metric keeps
    its name; a framework metric of the same name moves to `<name>_framework`, so both are logged."""
    merged = dict(kernel_metrics)
    logged_as = {}
    for name, value in framework_metrics.items():
        logged_as[name] = name + FRAMEWORK_METRIC_SUFFIX if name in kernel_metrics else name
        merged[logged_as[name]] = value
    return merged, logged_as


def correction_names(value: Any) -> tuple[str, ...]:
    """config.off_policy_corrections as a tuple of names ("a,b", ["a", "b"] or None)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, Sequence):
        return tuple(str(name) for name in value)
    raise ValueError(f"algorithm.off_policy_corrections must be a list of names, got {value!r}")


class ActorSpecialization(Specialization):
    """Policy-gradient actor (GRPO, Dr. GRPO, GSPO, DAPO, CISPO, REINFORCE++, RLOO, PPO's actor).

    Per response token: ratio_t = exp(log pi(a_t) - log pi_old(a_t)); loss_t = policy_loss(ratio_t, A_t)
    from the policy-loss registry (ppo_clip, gspo, cispo, ...), aggregated as the run's
    loss_agg_mode, plus an optional KL(pi || pi_ref) term and entropy bonus (see the module doc).

    Batch: `loss_masks`, `advantages`; `ref_log_probs` with use_kl_loss; `rollout_log_probs`
    for off-policy corrections and the train/rollout mismatch metrics; `log_probs` (pi_old) when
    recomputed (otherwise pi_old is this forward's detached log pi: exact when a rollout feeds
    one optimizer step). Config (the run's algorithm section): advantage_estimator,
    policy_loss, loss_agg_mode, clip_ratio_low/high/c, use_kl_loss, kl_loss_type,
    kl_loss_coef, entropy_coef, off_policy_corrections, rollout_temperature,
    recompute_old_log_probs, log_entropy (True: entropy is computed, detached, as a metric
    even when entropy_coef is 0).
    """

    def __init__(self, config: AlgorithmConfig | None = None, groups=None):
        super().__init__(config, groups)
        # Resolve every name now: an unknown one fails at construction, listing the known names.
        self.policy_loss_name = str(self.config.policy_loss)
        self.policy_loss_fn = get_policy_loss(self.policy_loss_name)
        self.corrections = correction_names(self.config.off_policy_corrections)
        self.correction_fns = [get_off_policy_correction(name) for name in self.corrections]
        # Traits come from each kernel's registry entry (declared where it is registered).
        self.policy_loss_traits = get_policy_loss_traits(self.policy_loss_name)
        self.correction_traits = [get_off_policy_correction_traits(name) for name in self.corrections]
        self.use_kl_loss = bool(self.config.use_kl_loss)
        if self.use_kl_loss:
            get_kl_estimator(str(self.config.kl_loss_type))
        self.entropy_coef = float(self.config.entropy_coef)
        # A kernel with its own entropy bonus gets none from the framework (no term counted twice).
        self.kl_and_entropy_config = (dataclasses.replace(self.config, entropy_coef=0.0)
                                      if self.policy_loss_traits.applies_entropy_bonus else self.config)
        self.kept_token_metrics: set[str] = set()
        """`<metric>_kept_mean` names: policy/KL/entropy sums over kept tokens, divided by the
        kept-token count (filled by compute_loss when corrections are on)."""

    @property
    def metric_denominators(self) -> dict[str, str]:
        return {name: NUM_KEPT_LOSS_TOKENS for name in self.kept_token_metrics}

    # ---- what the trainer loop asks ------------------------------------------------------------

    def required_fields(self) -> tuple[str, ...]:
        fields = ["advantages"]
        if self.use_kl_loss:
            fields.append("ref_log_probs")
        if self.corrections:
            fields.append("rollout_log_probs")
        return tuple(fields)

    def needs_reference(self) -> bool:
        return self.use_kl_loss

    def needs_old_log_probs(self) -> bool:
        return bool(self.config.recompute_old_log_probs)

    @property
    def temperature(self) -> float:
        """Training log-probs use the sampling temperature, like the rollout engine's."""
        return float(self.config.rollout_temperature)

    def needs_whole_sequences(self) -> bool:
        """Whether the loss needs whole responses (one CP all-gather per micro-batch when cp > 1):
        unless the policy loss and every correction are registered `token_local=True`."""
        return not (self.policy_loss_traits.token_local and all(t.token_local for t in self.correction_traits))

    @property
    def with_entropy(self) -> bool:
        """Entropy is computed only when it carries a coefficient or is logged (`log_entropy`)."""
        return self.entropy_coef != 0.0 or bool(self.config.log_entropy)

    # ---- the loss -----------------------------------------------------------------------------

    def needs_logits(self) -> bool:
        """False: `local_values` reads the model output only through `token_log_probs`."""
        return False

    def local_values(self, model_output: torch.Tensor, batch) -> torch.Tensor:
        """log pi [T_local], stacked with the entropy [T_local, 2] when it is needed: both travel in
        the same (at most one) CP all-gather."""
        log_probs_local, entropy_local = self.token_log_probs(
            model_output, batch, with_entropy=self.with_entropy, entropy_requires_grad=self.entropy_coef != 0.0
        )
        return log_probs_local if entropy_local is None else torch.stack([log_probs_local, entropy_local], -1)

    @classmethod
    def reads_advantages(cls) -> bool:
        return True

    @classmethod
    def policy_loss_in_use(cls) -> bool:
        """True unless a subclass replaces the loss assembly (`per_token_terms` or `compute_loss`)."""
        return not _overrides_below(cls, ActorSpecialization, ("per_token_terms", "compute_loss"))

    def per_token_terms(self, view, batch) -> LossTerms:
        if self.with_entropy:
            log_probs, entropy = [v[:, 0] for v in view.values], [v[:, 1] for v in view.values]
        else:
            log_probs, entropy = view.values, None
        raw_masks, advantages = view.loss_masks, view.cut(batch.advantages)
        current = [lp.detach() for lp in log_probs]
        old = view.cut(batch.log_probs) if batch.log_probs is not None else current
        rollout = view.cut(batch.rollout_log_probs) if batch.rollout_log_probs is not None else None
        ref = view.cut(batch.ref_log_probs) if self.use_kl_loss else None

        kernel_metrics: dict[str, torch.Tensor] = {}  # the corrections' and the policy loss's own
        framework_metrics: dict[str, torch.Tensor] = {}  # mismatch, KL and entropy, computed here
        masks, weights = raw_masks, None
        if rollout is not None:
            # Train/rollout mismatch: the trainer's log-probs of pi_old against the engine's.
            framework_metrics.update(mismatch_metrics(old, rollout, raw_masks))
            for correction, traits in zip(self.correction_fns, self.correction_traits):
                train = current if traits.uses_current_policy else old
                result = correction(self.config, train, rollout, masks, advantages=advantages)
                masks = result.loss_masks
                if result.weights is not None:
                    weights = result.weights if weights is None else [a * b for a, b in zip(weights, result.weights)]
                kernel_metrics.update({k: v for k, v in result.metrics.items() if not k.startswith("mismatch_")})

        traits = self.policy_loss_traits
        extra = {"importance_weights": weights} if traits.applies_importance_weights else {}
        per_token, policy_metrics = self.policy_loss_fn(
            self.config, old, log_probs, advantages, masks,
            raw_loss_masks=raw_masks, rollout_log_prob=rollout, ref_log_prob=ref, entropy=entropy, **extra,
        )
        if weights is not None and not traits.applies_importance_weights:
            per_token = [loss * w.to(loss.dtype) for loss, w in zip(per_token, weights)]
        per_token, kl_entropy_metrics = add_kl_and_entropy_terms(
            self.kl_and_entropy_config, per_token, log_probs, masks, ref_log_prob=ref, entropy=entropy
        )
        kernel_metrics.update(policy_metrics)
        framework_metrics.update(kl_entropy_metrics)
        metrics, logged_as = merge_kernel_and_framework_metrics(kernel_metrics, framework_metrics)
        if self.corrections:
            # The policy/KL/entropy sums are logged over the global loss-token count (guide 000);
            # their means over the tokens the corrections kept are separate metrics.
            metrics[NUM_KEPT_LOSS_TOKENS] = loss_token_counts(masks).sum().to(torch.float64)
            for name in (*policy_metrics, *(logged_as[name] for name in kl_entropy_metrics)):
                metrics[name + KEPT_MEAN_SUFFIX] = metrics[name]
                self.kept_token_metrics.add(name + KEPT_MEAN_SUFFIX)
        return LossTerms(per_token, metrics, masks=masks)
