"""Building blocks shared by the catalog's families."""

from __future__ import annotations

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.specializations.actor import ActorSpecialization
from stacx.trainer.config.recipe import ModelRole, TrainingConfig


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


def rl_recipe(name: str, description: str, algorithm: AlgorithmConfig) -> TrainingConfig:
    """Single-role RL: the policy generates, a reward scores, the estimator and loss come from `algorithm`."""
    return TrainingConfig(
        name=name,
        roles=(policy_role(ActorSpecialization, description="policy trained by policy gradient; serves the rollouts"),),
        syncs=(),
        description=description,
        algorithm=algorithm,
        data_source="rollout",
        uses_reward=True,
    )
