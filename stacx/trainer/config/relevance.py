"""Which settings a recipe reads: what `stacx train --dry-run` shows of the resolved config.

The full config is what a run saves (`run_config.json`); the dry run shows the settings the
recipe's roles, data source and losses read, plus every setting the user gave (a setting is never
hidden when it was set, even where this recipe ignores it).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.trainer.config.recipe import TrainingConfig

SAMPLING_FIELDS = ("rollout_engine", "rollout_urls", "n_samples_per_prompt", "rollout_max_response_len",
                   "rollout_temperature", "rollout_top_p", "rollout_top_k", "rollout_seed", "dynamic_sampling",
                   "over_sampling_factor", "save_rollouts_per_step", "rollout_mode")
ASYNC_FIELDS = ("max_staleness", "partial_rollout")
"""Read only in --rollout-mode async."""
REWARD_FIELDS = ("reward_fn", "reward_timeout_s")
ENGINE_FAULT_FIELDS = ("rollout_num_engines", "min_live_engines", "engine_deadline_s", "engine_health_interval_s")
"""Read only with several rollout engines (the pool watches them)."""
EPISODE_FAULT_FIELDS = ("episode_retries", "max_dropped_fraction")
"""Read only when an episode fails for an infrastructure reason: shown when given."""
EVAL_DETAIL_FIELDS = ("eval_interval", "eval_n_samples", "eval_temperature")
ROLLIN_FIELDS = ("dagger_sampling_mode", "dagger_sft_mode", "trajectory_corpus", "dagger_beta_schedule",
                 "dagger_beta_start", "dagger_beta_end", "dagger_beta_iters", "dagger_kappa_start",
                 "dagger_kappa_step", "dagger_kappa_cap")
POLICY_LOSS_FIELDS = ("policy_loss", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
                      "entropy_coef", "log_entropy", "recompute_old_log_probs", "use_kl_loss",
                      "off_policy_corrections")
KL_LOSS_FIELDS = ("kl_loss_type", "kl_loss_coef")
CORRECTION_FIELDS = ("tis_threshold", "mis_lower", "mis_upper", "opsm_delta", "m2po_threshold")
ADVANTAGE_FIELDS = ("advantage_estimator", "norm_adv_by_std", "whiten_advantages", "adv_eps",
                    "use_kl_in_reward", "filter_zero_variance_groups")
KL_IN_REWARD_FIELDS = ("kl_in_reward_type", "kl_in_reward_coef")
OVERLONG_FIELDS = ("overlong_buffer_length", "overlong_buffer_fraction", "overlong_penalty_factor")
RETURN_FIELDS = ("gamma", "lam")
RETURN_ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The built-in estimators that read gamma (and gae also lam)."""
CRITIC_FIELDS = ("value_clip",)
DPO_FIELDS = ("dpo_beta", "dpo_loss_type", "dpo_average_log_prob", "label_smoothing")
AGENT_FIELDS = ("agent", "agent_command", "agent_max_parallel_episodes", "agent_env", "agent_timeout")
"""Read only with an external agent as the rollout (--agent / --agent-command)."""
MOE_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "expert_model_parallel_size", "expert_tensor_parallel_size")
"""Read only for a mixture-of-experts checkpoint."""
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_plus_ratio", "lora_rslora",
               "lora_init", "lora_sync", "lora_critic")
"""Read only with --lora-rank > 0 (LoRA adapters on); a full fine-tune shows none of them (lora_critic: only in a
recipe with a critic)."""
FAULT_FIELDS = ("max_restarts", "dump_rollouts", "replay_rollouts")
"""How a run survives and records its parts (any recipe): shown when given, not as defaults."""
DISTILL_FIELDS = ("teacher_kl_coef", "student_top_k", "distill_topk_renormalize", "distill_kl_mode", "teacher_top_k")


def _engine_attaches(name: str, rollout_urls) -> bool:
    """Whether the engine kind `name` attaches to --rollout-urls (False for a name the preflight refuses; a kind that
    attaches them beside the servers it launches, only when they are given)."""
    try:
        kind = resolve_engine_kind(name)
        return kind.attaches or kind.attaches_with_urls or (kind.attaches_beside_launched and bool(rollout_urls))
    except ValueError:
        return False


def _is_mixture_of_experts(hf_checkpoint: Any) -> bool:
    """Whether --hf-checkpoint's config.json describes routed experts (False when it cannot be read)."""
    if not isinstance(hf_checkpoint, str):
        return False
    try:
        with open(os.path.join(hf_checkpoint, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(config.get(key) for key in ("num_experts", "num_local_experts"))


def _section_filters(recipe: TrainingConfig, algorithm: AlgorithmConfig,
                     resolved: Mapping[str, Any]) -> dict[str, Callable[[str], bool]]:
    """section -> whether the recipe reads a field of it."""
    rollout_values = resolved.get("rollout", {})
    engine_attaches = _engine_attaches(rollout_values.get("rollout_engine", "auto"), rollout_values.get("rollout_urls"))
    has_eval_data = rollout_values.get("eval_data") is not None
    trainable = [role.specialization_cls for role in recipe.roles if role.trainable]
    runs_policy_loss = any(cls.policy_loss_in_use() for cls in trainable)
    uses_advantages = runs_policy_loss or any(cls.reads_advantages() for cls in trainable)
    has_critic = any(role.outputs_values for role in recipe.roles)
    is_dpo = any(cls.reads_preference_pairs for cls in trainable)
    rollout = recipe.data_source == "rollout"
    checkpoint_args = {role.checkpoint_arg for role in recipe.roles}
    checkpoint_args |= {role.reference_checkpoint_arg for role in recipe.roles if role.reference_checkpoint_arg}
    a = algorithm

    moe = _is_mixture_of_experts(resolved.get("model", {}).get("hf_checkpoint"))

    def model(name: str) -> bool:
        if name in MOE_FIELDS:
            return moe
        if name in LORA_FIELDS:
            return int(resolved.get("model", {}).get("lora_rank") or 0) > 0 and (name != "lora_critic" or has_critic)
        return name not in ("ref_load", "critic_load") or name in checkpoint_args

    def parallel(name: str) -> bool:
        return moe or name not in MOE_FIELDS

    def rollout_section(name: str) -> bool:
        if name == "rollout_urls":
            return rollout and engine_attaches
        if name == "attached_engine_wait_s":  # a failed attached engine is waited for, one or several
            return rollout and engine_attaches
        if name in ("vllm_python", "vllm_weight_transfer"):
            return rollout and rollout_values.get("rollout_engine") == "vllm"
        if name == "weight_check_every":  # every push is checked unless it says otherwise: shown when given
            return False
        if name in EVAL_DETAIL_FIELDS:
            return has_eval_data
        if name in ENGINE_FAULT_FIELDS:
            return rollout and (int(rollout_values.get("rollout_num_engines") or 1) > 1
                                or len(rollout_values.get("rollout_urls") or ()) > 1)
        if name in EPISODE_FAULT_FIELDS:
            return False
        if name in ASYNC_FIELDS:
            return rollout and rollout_values.get("rollout_mode") == "async"
        if name in SAMPLING_FIELDS:
            return rollout
        if name in REWARD_FIELDS:
            return recipe.uses_reward
        if name in AGENT_FIELDS:
            return bool(rollout_values.get("agent") or rollout_values.get("agent_command"))
        return True

    def train(name: str) -> bool:
        if name == "use_critic":
            return has_critic
        return name != "dry_run" and name not in FAULT_FIELDS  # a dry run knows it is one

    def teacher(name: str) -> bool:
        if name in ROLLIN_FIELDS:
            return recipe.rollin_protocol is not None
        return recipe.uses_teacher

    def algorithm_section(name: str) -> bool:
        groups = [
            (POLICY_LOSS_FIELDS, runs_policy_loss),
            (KL_LOSS_FIELDS, runs_policy_loss and a.use_kl_loss),
            (CORRECTION_FIELDS, runs_policy_loss and bool(a.off_policy_corrections)),
            (ADVANTAGE_FIELDS, uses_advantages),
            (KL_IN_REWARD_FIELDS, uses_advantages and a.use_kl_in_reward),
            (OVERLONG_FIELDS, uses_advantages and (a.overlong_buffer_length is not None
                                                   or a.overlong_buffer_fraction is not None)),
            (RETURN_FIELDS, has_critic or a.advantage_estimator in RETURN_ESTIMATORS),
            (CRITIC_FIELDS, has_critic),
            (DPO_FIELDS, is_dpo),
            (DISTILL_FIELDS, recipe.uses_teacher),
            (("rollout_temperature",), rollout),
        ]
        for fields, used in groups:
            if name in fields:
                return used
        return True  # name, loss_agg_mode, custom hyperparameters

    return {"model": model, "parallel": parallel, "rollout": rollout_section, "teacher": teacher, "train": train,
            "algorithm": algorithm_section}


def settings_the_recipe_reads(resolved: Mapping[str, Any], recipe: TrainingConfig, algorithm: AlgorithmConfig,
                              given_keys: frozenset[str] = frozenset()) -> tuple[dict[str, Any], int]:
    """(the resolved config without the settings the recipe does not read, how many were left out).

    `resolved`: `resolved_run_config_dict`'s sections; `given_keys`: field names the user set."""
    filters = _section_filters(recipe, algorithm, resolved)
    given = set(given_keys) | set(algorithm.given_keys)
    shown: dict[str, Any] = {}
    left_out = 0
    for section, values in resolved.items():
        keep = filters.get(section, lambda name: True)
        if not isinstance(values, Mapping):
            shown[section] = values
            continue
        kept = {name: value for name, value in values.items() if keep(name) or name in given}
        left_out += len(values) - len(kept)
        if kept:
            shown[section] = kept
    return shown, left_out
