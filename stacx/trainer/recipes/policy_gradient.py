"""Reinforcement-learning recipes: one specialization (`ActorSpecialization`, plus a critic for PPO),
different algorithm data (`recipe_algorithm(...)` overrides: data, not code)."""

from __future__ import annotations

from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.critic import CriticSpecialization
from stacx.trainer.config.recipe import ExchangeSync, InjectSync, ModelRole, TrainingConfig, recipe, recipe_algorithm
from stacx.trainer.recipes.blocks import policy_role, rl_recipe


REFERENCE_REFRESH_EVERY_N_STEPS = 50
"""Default refresh interval of grpo_reference_refresh's reference role (steps)."""


SINGLE_POLICY_RECIPES: dict[str, tuple[str, dict]] = {
    "grpo": (
        "GRPO: rewards normalized within each prompt's group (mean and std), PPO-clipped policy loss; optional "
        "low-variance KL to the in-worker reference (--use-kl-loss with --ref-load).",
        dict(advantage_estimator="grpo", policy_loss="ppo_clip", loss_agg_mode="token-mean", clip_ratio_low=0.2,
             clip_ratio_high=0.2, kl_loss_type="low_var_kl", kl_loss_coef=0.001),
    ),
    "dr_grpo": (
        "Dr. GRPO: group-centered rewards without std normalization, and a constant (max-length) loss normalizer "
        "instead of per-sequence lengths, removing GRPO's length and difficulty biases.",
        dict(advantage_estimator="dr_grpo", policy_loss="ppo_clip", loss_agg_mode="seq-mean-token-sum-norm",
             norm_adv_by_std=False),
    ),
    "gspo": (
        "GSPO: group-normalized advantages with a sequence-level importance ratio (geometric mean of token "
        "ratios) clipped in a narrow band.",
        dict(advantage_estimator="grpo", policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
             clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    ),
    "dapo": (
        "DAPO: GRPO advantages with clip-higher (0.2/0.28), token-level loss aggregation, dynamic sampling that "
        "drops zero-variance groups, soft overlong punishment and no KL term.",
        dict(advantage_estimator="grpo", policy_loss="ppo_clip", loss_agg_mode="token-mean", clip_ratio_low=0.2,
             clip_ratio_high=0.28, filter_zero_variance_groups=True, overlong_buffer_fraction=0.2,
             overlong_penalty_factor=1.0),
    ),
    "cispo": (
        "CISPO: the importance weight itself is clipped and detached (no lower bound, upper 1+0.28) and "
        "multiplies the log-probability gradient, so no token's gradient is dropped.",
        dict(advantage_estimator="grpo", policy_loss="cispo", loss_agg_mode="token-mean", clip_ratio_low=1.0,
             clip_ratio_high=0.28),
    ),
    "reinforce_pp": (
        "REINFORCE++: discounted token returns with a per-token KL penalty in the reward, whitened over the "
        "global batch; PPO-clipped loss.",
        dict(advantage_estimator="reinforce_plus_plus", policy_loss="ppo_clip", use_kl_in_reward=True,
             kl_in_reward_coef=0.01, kl_loss_type="k1"),
    ),
    "reinforce_pp_baseline": (
        "REINFORCE++ with a group-mean baseline: rewards centered within each prompt's group, then whitened over "
        "the global batch; k2 KL loss to the reference.",
        dict(advantage_estimator="reinforce_plus_plus_baseline", policy_loss="ppo_clip", use_kl_loss=True,
             kl_loss_type="k2", kl_loss_coef=0.001),
    ),
    "rloo": (
        "RLOO: each sample's baseline is the mean reward of the other samples of its prompt; PPO-clipped loss.",
        dict(advantage_estimator="rloo", policy_loss="ppo_clip", loss_agg_mode="token-mean", norm_adv_by_std=False),
    ),
}
"""Single-policy RL recipes by name: (description, `recipe_algorithm` overrides). They share one role and one
specialization (`ActorSpecialization`) and differ only in this data."""


def _register_single_policy_recipe(name: str, description: str, overrides: dict) -> None:
    recipe(name)(lambda: rl_recipe(name, description, recipe_algorithm(**overrides)))


for _name, (_description, _overrides) in SINGLE_POLICY_RECIPES.items():
    _register_single_policy_recipe(_name, _description, _overrides)


@recipe("grpo_reference_refresh")
def grpo_reference_refresh_config() -> TrainingConfig:
    return TrainingConfig(
        name="grpo_reference_refresh",
        roles=(
            policy_role(ActorSpecialization, with_reference=False,
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
            "turns rewards and values into advantages and returns, and both roles train every step (with LoRA, "
            "--lora-critic adapters trains the critic's adapters and value head, frozen trains it not at all)."
        ),
        algorithm=recipe_algorithm(advantage_estimator="gae", policy_loss="ppo_clip", loss_agg_mode="token-mean",
                                    gamma=1.0, lam=0.95, value_clip=0.5),
        data_source="rollout",
        uses_reward=True,
    )

