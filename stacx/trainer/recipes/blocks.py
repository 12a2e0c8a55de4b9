"""Building blocks shared by the catalog's families."""

from __future__ import annotations

from typing import Any, Mapping

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.specializations.actor import ActorSpecialization
from stacx.trainer.config.recipe import ModelRole, TrainingConfig, recipe


def policy_role(specialization_cls: type, *, with_reference: bool = True, sync_to_rollout: bool = True,
                description: str = "the model being trained") -> ModelRole:
    """The trained model; with `with_reference`, --ref-load keeps a frozen reference in its workers."""
    return ModelRole(
        name="policy",
        specialization_cls=specialization_cls,
        trainable=True,
        sync_to_rollout=sync_to_rollout,
        checkpoint_arg="hf_checkpoint",
        reference_checkpoint_arg="ref_load" if with_reference else None,
        description=description,
    )


def single_policy_recipe(name: str, description: str, role: ModelRole, **fields: Any) -> TrainingConfig:
    """A recipe of one trainable `policy` role and no syncs; `fields` are its other `TrainingConfig` fields."""
    return TrainingConfig(name=name, roles=(role,), syncs=(), description=description, **fields)


def rl_recipe(name: str, description: str, algorithm: AlgorithmConfig) -> TrainingConfig:
    """Single-role RL: the policy generates, a reward scores, the estimator and loss come from `algorithm`."""
    role = policy_role(ActorSpecialization, description="policy trained by policy gradient; serves the rollouts")
    return single_policy_recipe(name, description, role, algorithm=algorithm, data_source="rollout", uses_reward=True)


SinglePolicyRecipe = tuple[str, ModelRole, Mapping[str, Any]]
"""(description, the policy role, the recipe's other `TrainingConfig` fields)."""


def register_single_policy_recipes(recipes: Mapping[str, SinglePolicyRecipe]) -> None:
    """`@recipe` every entry: name -> (description, role, fields) (`single_policy_recipe`)."""
    for name, (description, role, fields) in recipes.items():
        recipe(name)(lambda name=name, description=description, role=role, fields=fields:
                     single_policy_recipe(name, description, role, **fields))
