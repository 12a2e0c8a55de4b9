"""Distillation recipes: on-policy distillation from a teacher server, DAgger and AggreVaTe roll-ins."""

from __future__ import annotations

from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.specializations.distill import DistillSpecialization
from stacx.specializations.mixed_loss_dagger import MixedLossDaggerOPDSpecialization
from stacx.trainer.config.recipe import TrainingConfig, recipe, recipe_algorithm
from stacx.trainer.recipes.blocks import policy_role


@recipe("online_dagger")
def online_dagger_config() -> TrainingConfig:
    return TrainingConfig(
        name="online_dagger",
        roles=(policy_role(CausalDecoderSpecialization, with_reference=False,
                       description="student: rolls in, then trained by cross-entropy on the teacher's actions"),),
        syncs=(),
        description=(
            "Iterative SFT (DAgger): the student rolls out, the teacher server relabels the visited states, and the "
            "student is trained by cross-entropy on the teacher's actions. With trajectory replay it trains on a "
            "saved teacher corpus instead of live roll-ins."
        ),
        data_source="rollout",
        uses_teacher=True,
        rollin_protocol="teacher_relabel",
    )


@recipe("opd")
def opd_config() -> TrainingConfig:
    return TrainingConfig(
        name="opd",
        roles=(policy_role(DistillSpecialization, with_reference=False,
                       description="student trained by reverse KL to the teacher on its own samples"),),
        syncs=(),
        description=(
            "On-policy distillation: the student samples, a frozen teacher server scores every sampled token, and the "
            "loss is the k3 estimate of reverse KL(student || teacher)."
        ),
        data_source="rollout",
        uses_teacher=True,
    )


@recipe("opd_rl")
def opd_rl_config() -> TrainingConfig:
    return TrainingConfig(
        name="opd_rl",
        roles=(policy_role(ActorSpecialization, description="policy trained on task reward shaped by reverse KL to the teacher"),),
        syncs=(),
        description=(
            "RL on the task reward plus reverse-KL shaping against a teacher server: each token's reward is reduced by "
            "teacher_kl_coef * (log pi - log pi_teacher); group-normalized advantages, PPO-clipped loss."
        ),
        algorithm=recipe_algorithm(advantage_estimator="grpo", policy_loss="ppo_clip", teacher_kl_coef=0.1),
        data_source="rollout",
        uses_teacher=True,
        uses_reward=True,
    )


@recipe("mixture_dagger_opd")
def mixture_dagger_opd_config() -> TrainingConfig:
    return TrainingConfig(
        name="mixture_dagger_opd",
        roles=(policy_role(MixedLossDaggerOPDSpecialization, with_reference=False,
                       description="student: cross-entropy on teacher-executed tokens, k3 reverse KL on its own"),),
        syncs=(),
        description=(
            "Mixed-loss DAgger-OPD with a per-turn beta-mixture roll-in: each turn is executed by the teacher with "
            "probability beta (decaying over training); teacher tokens get cross-entropy, student tokens k3 reverse KL."
        ),
        data_source="rollout",
        uses_teacher=True,
        rollin_protocol="beta_mixture",
    )


@recipe("mixture_aggrevate_opd")
def mixture_aggrevate_opd_config() -> TrainingConfig:
    return TrainingConfig(
        name="mixture_aggrevate_opd",
        roles=(policy_role(MixedLossDaggerOPDSpecialization, with_reference=False,
                       description="student: cross-entropy on teacher-executed tokens, k3 reverse KL on its own"),),
        syncs=(),
        description=(
            "Mixed-loss DAgger-OPD with a trajectory-level AggreVaTe roll-in: the student leads turns 0..kappa-1 "
            "(kappa ~ U{0, T_max(i)}, T_max growing over training) and the teacher completes the tail."
        ),
        data_source="rollout",
        uses_teacher=True,
        rollin_protocol="aggrevate",
    )


