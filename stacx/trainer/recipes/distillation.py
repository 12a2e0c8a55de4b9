"""Distillation recipes: on-policy distillation from a teacher server, DAgger and AggreVaTe roll-ins."""

from __future__ import annotations

from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.specializations.distill import DistillSpecialization
from stacx.specializations.mixed_loss_dagger import MixedLossDaggerOPDSpecialization
from stacx.trainer.config.recipe import recipe_algorithm
from stacx.trainer.recipes.blocks import SinglePolicyRecipe, policy_role, register_single_policy_recipes

MIXED_LOSS_STUDENT = policy_role(
    MixedLossDaggerOPDSpecialization, with_reference=False,
    description="student: cross-entropy on teacher-executed tokens, k3 reverse KL on its own")

DISTILLATION_RECIPES: dict[str, SinglePolicyRecipe] = {
    "online_dagger": (
        "Iterative SFT (DAgger): the student rolls out, the teacher server relabels the visited states, and the "
        "student is trained by cross-entropy on the teacher's actions. With trajectory replay it trains on a "
        "saved teacher corpus instead of live roll-ins.",
        policy_role(CausalDecoderSpecialization, with_reference=False,
                    description="student: rolls in, then trained by cross-entropy on the teacher's actions"),
        dict(data_source="rollout", uses_teacher=True, rollin_protocol="teacher_relabel"),
    ),
    "opd": (
        "On-policy distillation: the student samples, a frozen teacher server scores every sampled token, and the "
        "loss is the k3 estimate of reverse KL(student || teacher).",
        policy_role(DistillSpecialization, with_reference=False,
                    description="student trained by reverse KL to the teacher on its own samples"),
        dict(data_source="rollout", uses_teacher=True),
    ),
    "opd_rl": (
        "RL on the task reward plus reverse-KL shaping against a teacher server: each token's reward is reduced by "
        "teacher_kl_coef * (log pi - log pi_teacher); group-normalized advantages, PPO-clipped loss.",
        policy_role(ActorSpecialization,
                    description="policy trained on task reward shaped by reverse KL to the teacher"),
        dict(algorithm=recipe_algorithm(advantage_estimator="grpo", policy_loss="ppo_clip", teacher_kl_coef=0.1),
             data_source="rollout", uses_teacher=True, uses_reward=True),
    ),
    "mixture_dagger_opd": (
        "Mixed-loss DAgger-OPD with a per-turn beta-mixture roll-in: each turn is executed by the teacher with "
        "probability beta (decaying over training); teacher tokens get cross-entropy, student tokens k3 reverse KL.",
        MIXED_LOSS_STUDENT,
        dict(data_source="rollout", uses_teacher=True, rollin_protocol="beta_mixture"),
    ),
    "mixture_aggrevate_opd": (
        "Mixed-loss DAgger-OPD with a trajectory-level AggreVaTe roll-in: the student leads turns 0..kappa-1 "
        "(kappa ~ U{0, T_max(i)}, T_max growing over training) and the teacher completes the tail.",
        MIXED_LOSS_STUDENT,
        dict(data_source="rollout", uses_teacher=True, rollin_protocol="aggrevate"),
    ),
}
"""The distillation family by name: (description, the student role, the other recipe fields)."""

register_single_policy_recipes(DISTILLATION_RECIPES)
