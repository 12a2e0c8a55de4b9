"""Supervised recipes: SFT and DPO on a dataset (no rollouts)."""

from __future__ import annotations

from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.specializations.dpo import DPOSpecialization
from stacx.trainer.recipes.blocks import SinglePolicyRecipe, policy_role, register_single_policy_recipes

SUPERVISED_RECIPES: dict[str, SinglePolicyRecipe] = {
    "sft": (
        "Supervised fine-tuning: cross-entropy on the response tokens of a fixed dataset.",
        policy_role(CausalDecoderSpecialization, with_reference=False, sync_to_rollout=False,
                    description="model trained by cross-entropy on dataset responses"),
        dict(data_source="dataset"),
    ),
    "dpo": (
        "Direct preference optimization on (chosen, rejected) pairs from a dataset, against a frozen reference held "
        "in the policy's workers.",
        policy_role(DPOSpecialization, sync_to_rollout=False,
                    description="policy trained on preference pairs; --ref-load holds the frozen reference"),
        dict(data_source="dataset"),
    ),
}
"""The supervised family by name: (description, the policy role, the other recipe fields)."""

register_single_policy_recipes(SUPERVISED_RECIPES)
