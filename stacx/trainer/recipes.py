"""The recipe catalog: every algorithm Stacx runs, as a frozen `TrainingConfig` built at import.

    @recipe("my_algo")
    def my_algo_config() -> TrainingConfig:
        return TrainingConfig(name="my_algo", roles=(ModelRole(name="policy", ...),), syncs=(), description="...")

`@recipe` calls the function once, checks the result and registers it in `TRAINING_CONFIGS`; a
malformed recipe raises `RecipeError` naming the recipe and the field while this module (or the
module defining it) is imported, never mid-run. The RL recipes share `ActorSpecialization` and
differ only in their `recipe_algorithm(...)` overrides (data, not code).
"""

from __future__ import annotations

from typing import Callable

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.specializations.critic import CriticSpecialization
from stacx.specializations.distill import DistillSpecialization
from stacx.specializations.dpo import DPOSpecialization
from stacx.specializations.mixed_loss_dagger import MixedLossDaggerOPDSpecialization
from stacx.trainer.config.recipe import (
    ExchangeSync,
    InjectSync,
    ModelRole,
    RecipeError,
    TrainingConfig,
    _check_identifier,
    recipe_algorithm,
)

TRAINING_CONFIGS: dict[str, TrainingConfig] = {}
"""Recipe name -> its validated TrainingConfig, filled by @recipe at import."""


def recipe(name: str) -> Callable[[Callable[[], TrainingConfig]], Callable[[], TrainingConfig]]:
    """Decorator: build the recipe now, validate it and register it under `name` (duplicates are rejected)."""
    try:
        _check_identifier("name", name)
    except RecipeError as err:
        raise RecipeError(f"@recipe({name!r}): {err}") from None

    def decorator(build: Callable[[], TrainingConfig]) -> Callable[[], TrainingConfig]:
        if name in TRAINING_CONFIGS:
            raise RecipeError(f"recipe {name!r}: field 'name': a recipe with this name is already registered")
        try:
            config = build()
        except RecipeError as err:
            message = str(err)
            raise RecipeError(message if message.startswith(f"recipe {name!r}") else f"recipe {name!r}: {message}") from None
        except TypeError as err:  # a missing or misspelled dataclass field
            raise RecipeError(f"recipe {name!r}: {err}") from None
        if not isinstance(config, TrainingConfig):
            raise RecipeError(f"recipe {name!r}: {build.__name__}() must return a TrainingConfig, got {type(config).__name__}")
        if config.name != name:
            raise RecipeError(f"recipe {name!r}: field 'name' is {config.name!r}; it must match @recipe({name!r})")
        TRAINING_CONFIGS[name] = config
        from stacx.objectives.discovery import record_user_module

        record_user_module(getattr(build, "__module__", None))  # a user recipe reaches Ray workers too
        return build

    return decorator


def get_recipe(name: str) -> TrainingConfig:
    """The registered recipe called `name`; RecipeError listing the known recipes otherwise."""
    try:
        return TRAINING_CONFIGS[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(TRAINING_CONFIGS))}") from None


# ---- building blocks shared by the catalog -----------------------------------------------------


def _policy(specialization_cls: type, *, with_reference: bool = True, sync_to_rollout: bool = True,
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


def _rl_recipe(name: str, description: str, algorithm: AlgorithmConfig) -> TrainingConfig:
    """Single-role RL: the policy generates, a reward scores, the estimator and loss come from `algorithm`."""
    return TrainingConfig(
        name=name,
        roles=(_policy(ActorSpecialization, description="policy trained by policy gradient; serves the rollouts"),),
        syncs=(),
        description=description,
        algorithm=algorithm,
        data_source="rollout",
        uses_reward=True,
    )


# ---- supervised and distillation ---------------------------------------------------------------


@recipe("sft")
def sft_config() -> TrainingConfig:
    return TrainingConfig(
        name="sft",
        roles=(_policy(CausalDecoderSpecialization, with_reference=False, sync_to_rollout=False,
                       description="model trained by cross-entropy on dataset responses"),),
        syncs=(),
        description="Supervised fine-tuning: cross-entropy on the response tokens of a fixed dataset.",
        data_source="dataset",
    )


@recipe("online_dagger")
def online_dagger_config() -> TrainingConfig:
    return TrainingConfig(
        name="online_dagger",
        roles=(_policy(CausalDecoderSpecialization, with_reference=False,
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
        roles=(_policy(DistillSpecialization, with_reference=False,
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
        roles=(_policy(ActorSpecialization, description="policy trained on task reward shaped by reverse KL to the teacher"),),
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
        roles=(_policy(MixedLossDaggerOPDSpecialization, with_reference=False,
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
        roles=(_policy(MixedLossDaggerOPDSpecialization, with_reference=False,
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


@recipe("dpo")
def dpo_config() -> TrainingConfig:
    return TrainingConfig(
        name="dpo",
        roles=(_policy(DPOSpecialization, sync_to_rollout=False,
                       description="policy trained on preference pairs; --ref-load holds the frozen reference"),),
        syncs=(),
        description=(
            "Direct preference optimization on (chosen, rejected) pairs from a dataset, against a frozen reference held "
            "in the policy's workers."
        ),
        data_source="dataset",
    )


# ---- reinforcement learning: one specialization, different algorithm data ----------------------

REFERENCE_REFRESH_EVERY_N_STEPS = 50
"""Default refresh interval of grpo_reference_refresh's reference role (steps)."""


@recipe("grpo")
def grpo_config() -> TrainingConfig:
    return _rl_recipe(
        "grpo",
        "GRPO: rewards normalized within each prompt's group (mean and std), PPO-clipped policy loss; optional "
        "low-variance KL to the in-worker reference (--use-kl-loss with --ref-load).",
        recipe_algorithm(advantage_estimator="grpo", policy_loss="ppo_clip", loss_agg_mode="token-mean",
                          clip_ratio_low=0.2, clip_ratio_high=0.2, kl_loss_type="low_var_kl", kl_loss_coef=0.001),
    )


@recipe("dr_grpo")
def dr_grpo_config() -> TrainingConfig:
    return _rl_recipe(
        "dr_grpo",
        "Dr. GRPO: group-centered rewards without std normalization, and a constant (max-length) loss normalizer "
        "instead of per-sequence lengths, removing GRPO's length and difficulty biases.",
        recipe_algorithm(advantage_estimator="dr_grpo", policy_loss="ppo_clip",
                          loss_agg_mode="seq-mean-token-sum-norm", norm_adv_by_std=False),
    )


@recipe("gspo")
def gspo_config() -> TrainingConfig:
    return _rl_recipe(
        "gspo",
        "GSPO: group-normalized advantages with a sequence-level importance ratio (geometric mean of token ratios) "
        "clipped in a narrow band.",
        recipe_algorithm(advantage_estimator="grpo", policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                          clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    )


@recipe("dapo")
def dapo_config() -> TrainingConfig:
    return _rl_recipe(
        "dapo",
        "DAPO: GRPO advantages with clip-higher (0.2/0.28), token-level loss aggregation, dynamic sampling that drops "
        "zero-variance groups, soft overlong punishment and no KL term.",
        recipe_algorithm(advantage_estimator="grpo", policy_loss="ppo_clip", loss_agg_mode="token-mean",
                          clip_ratio_low=0.2, clip_ratio_high=0.28, filter_zero_variance_groups=True,
                          overlong_buffer_fraction=0.2, overlong_penalty_factor=1.0),
    )


@recipe("cispo")
def cispo_config() -> TrainingConfig:
    return _rl_recipe(
        "cispo",
        "CISPO: the importance weight itself is clipped and detached (no lower bound, upper 1+0.28) and multiplies "
        "the log-probability gradient, so no token's gradient is dropped.",
        recipe_algorithm(advantage_estimator="grpo", policy_loss="cispo", loss_agg_mode="token-mean",
                          clip_ratio_low=1.0, clip_ratio_high=0.28),
    )


@recipe("reinforce_pp")
def reinforce_pp_config() -> TrainingConfig:
    return _rl_recipe(
        "reinforce_pp",
        "REINFORCE++: discounted token returns with a per-token KL penalty in the reward, whitened over the global "
        "batch; PPO-clipped loss.",
        recipe_algorithm(advantage_estimator="reinforce_plus_plus", policy_loss="ppo_clip",
                          use_kl_in_reward=True, kl_in_reward_coef=0.01, kl_loss_type="k1"),
    )


@recipe("reinforce_pp_baseline")
def reinforce_pp_baseline_config() -> TrainingConfig:
    return _rl_recipe(
        "reinforce_pp_baseline",
        "REINFORCE++ with a group-mean baseline: rewards centered within each prompt's group, then whitened over the "
        "global batch; k2 KL loss to the reference.",
        recipe_algorithm(advantage_estimator="reinforce_plus_plus_baseline", policy_loss="ppo_clip",
                          use_kl_loss=True, kl_loss_type="k2", kl_loss_coef=0.001),
    )


@recipe("rloo")
def rloo_config() -> TrainingConfig:
    return _rl_recipe(
        "rloo",
        "RLOO: each sample's baseline is the mean reward of the other samples of its prompt; PPO-clipped loss.",
        recipe_algorithm(advantage_estimator="rloo", policy_loss="ppo_clip", loss_agg_mode="token-mean",
                          norm_adv_by_std=False),
    )


@recipe("grpo_reference_refresh")
def grpo_reference_refresh_config() -> TrainingConfig:
    return TrainingConfig(
        name="grpo_reference_refresh",
        roles=(
            _policy(ActorSpecialization, with_reference=False,
                    description="policy trained by GRPO with a KL loss to the reference role; serves the rollouts"),
            ModelRole(name="reference", specialization_cls=ActorSpecialization, trainable=False,
                      shares_pool_with="policy", checkpoint_arg="hf_checkpoint",
                      description="frozen KL anchor: starts as the initial policy, computes reference log-probs, "
                                  "and is overwritten by the policy's weights every N steps"),
        ),
        syncs=(
            InjectSync(source_role="reference", target_role="policy", keys=("ref_log_probs",)),
            ExchangeSync(source_role="policy", target_role="reference", keys=("weights",),
                         every_n_steps=REFERENCE_REFRESH_EVERY_N_STEPS),
        ),
        description=(
            "GRPO with a periodically refreshed reference (ProRL-style reference reset): the KL loss anchors the "
            f"policy to a frozen reference role, whose weights are replaced by the policy's every "
            f"{REFERENCE_REFRESH_EVERY_N_STEPS} steps (--exchange-every-n-steps) over an exchange sync, so long runs "
            "keep a KL leash without being pulled back to the initial model."
        ),
        algorithm=recipe_algorithm(advantage_estimator="grpo", policy_loss="ppo_clip", loss_agg_mode="token-mean",
                                    clip_ratio_low=0.2, clip_ratio_high=0.28, use_kl_loss=True,
                                    kl_loss_type="low_var_kl", kl_loss_coef=0.01),
        data_source="rollout",
        uses_reward=True,
    )


@recipe("ppo")
def ppo_config() -> TrainingConfig:
    return TrainingConfig(
        name="ppo",
        roles=(
            ModelRole(name="actor", specialization_cls=ActorSpecialization, trainable=True, sync_to_rollout=True,
                      checkpoint_arg="hf_checkpoint", reference_checkpoint_arg="ref_load",
                      description="policy trained with the PPO-clipped loss on GAE advantages"),
            ModelRole(name="critic", specialization_cls=CriticSpecialization, trainable=True, shares_pool_with="actor",
                      checkpoint_arg="critic_load",
                      description="value model; colocated with the actor and time-sharing its devices"),
        ),
        syncs=(InjectSync(source_role="critic", target_role="actor", keys=("values",)),),
        description=(
            "PPO with a learned critic: per-token values from the critic are injected into the actor's batch, GAE "
            "turns rewards and values into advantages and returns, and both roles train every step."
        ),
        algorithm=recipe_algorithm(advantage_estimator="gae", policy_loss="ppo_clip", loss_agg_mode="token-mean",
                                    gamma=1.0, lam=0.95, value_clip=0.5),
        data_source="rollout",
        uses_reward=True,
    )


__all__ = ["TRAINING_CONFIGS", "get_recipe", "recipe"]
