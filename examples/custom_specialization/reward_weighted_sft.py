"""A new algorithm in one file: reward-weighted SFT as a specialization, plus its recipe.

Reward-weighted regression trains on the policy's own samples by cross-entropy, each response
weighted by how much better than its group it scored:

    l_t = -w_i log pi(y_t | y_<t, x),   w_i = min(exp(A_i / rwr_temperature), rwr_max_weight)

with A_i the advantage (the recipe's estimator, e.g. GRPO's group-normalized reward). Load it with

    stacx train --custom-module examples/custom_specialization/reward_weighted_sft.py \
        --algorithm reward_weighted_sft --algorithm-param rwr_temperature=0.5 ...

docs/adding-an-algorithm.md walks through this file.
"""

from __future__ import annotations

import torch

from stacx.specializations.base import LossTerms, Specialization, masked_total
from stacx.trainer.config.recipe import ModelRole, TrainingConfig, recipe_algorithm
from stacx.trainer.recipes import recipe


class RewardWeightedSFTSpecialization(Specialization):
    """Cross-entropy on sampled responses, weighted per token by min(exp(A / rwr_temperature), rwr_max_weight).

    Batch: `loss_masks`, `advantages` (whole responses, [R_i]). Per-token only: no CP
    communication. Metrics (sums, logged per loss token): weighted_nll, mean_weight.
    """

    base_required_fields = ("advantages",)

    def per_token_terms(self, view, batch):
        # view.values: this rank's log-probs of each response; view.cut: a batch field cut alike.
        temperature = float(self.setting("rwr_temperature", 1.0))
        max_weight = float(self.setting("rwr_max_weight", 5.0))
        weights = [torch.exp(a / temperature).clamp(max=max_weight) for a in view.cut(batch.advantages)]
        per_token = [-w * lp for w, lp in zip(weights, view.values)]
        metrics = {"weighted_nll": masked_total(per_token, view.loss_masks),
                   "mean_weight": masked_total(weights, view.loss_masks)}
        return LossTerms(per_token, metrics)


@recipe("reward_weighted_sft")
def reward_weighted_sft_config() -> TrainingConfig:
    return TrainingConfig(
        name="reward_weighted_sft",
        roles=(
            ModelRole(name="policy", specialization_cls=RewardWeightedSFTSpecialization, trainable=True,
                      sync_to_rollout=True, description="policy trained by reward-weighted cross-entropy on its samples"),
        ),
        description=(
            "Reward-weighted SFT: the policy samples, GRPO advantages score each response within its group, and the "
            "policy is trained by cross-entropy weighted by exp(advantage / rwr_temperature)."
        ),
        algorithm=recipe_algorithm(advantage_estimator="grpo"),
        data_source="rollout",
        uses_reward=True,
    )
