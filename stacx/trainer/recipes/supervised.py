"""Supervised recipes: SFT and DPO on a dataset (no rollouts)."""

from __future__ import annotations

from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.specializations.dpo import DPOSpecialization
from stacx.trainer.config.recipe import TrainingConfig, recipe
from stacx.trainer.recipes.blocks import policy_role


@recipe("sft")
def sft_config() -> TrainingConfig:
    return TrainingConfig(
        name="sft",
        roles=(policy_role(CausalDecoderSpecialization, with_reference=False, sync_to_rollout=False,
                       description="model trained by cross-entropy on dataset responses"),),
        syncs=(),
        description="Supervised fine-tuning: cross-entropy on the response tokens of a fixed dataset.",
        data_source="dataset",
    )


@recipe("dpo")
def dpo_config() -> TrainingConfig:
    return TrainingConfig(
        name="dpo",
        roles=(policy_role(DPOSpecialization, sync_to_rollout=False,
                       description="policy trained on preference pairs; --ref-load holds the frozen reference"),),
        syncs=(),
        description=(
            "Direct preference optimization on (chosen, rejected) pairs from a dataset, against a frozen reference held "
            "in the policy's workers."
        ),
        data_source="dataset",
    )
