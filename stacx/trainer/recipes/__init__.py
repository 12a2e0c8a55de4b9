"""The recipe catalog: every algorithm Stacx runs, as a frozen `TrainingConfig` built at import.

    @recipe("my_algo")
    def my_algo_config() -> TrainingConfig:
        return TrainingConfig(name="my_algo", roles=(ModelRole(name="policy", ...),), syncs=(), description="...")

`@recipe` calls the function once, checks the result and registers it in `TRAINING_CONFIGS`; a
malformed recipe raises `RecipeError` naming the recipe and the field while this module (or the
module defining it) is imported, never mid-run. The RL recipes share `ActorSpecialization` and
differ only in their `recipe_algorithm(...)` overrides (data, not code).

The catalog, by family: `supervised` (sft, dpo), `distillation` (opd, DAgger and AggreVaTe
roll-ins), `policy_gradient` (GRPO and its variants, PPO). Recipes of other modalities come with
their workload (`stacx.trainer.config.workload`; the experimental diffusion family registers from
`stacx.diffusion.recipes` when `stacx.launch.workloads` discovers it). The registry itself (`recipe`,
`get_recipe`, `TRAINING_CONFIGS`) lives with the recipe model in `stacx.trainer.config.recipe`.
"""

from stacx.trainer.config.recipe import TRAINING_CONFIGS, get_recipe, recipe
from stacx.trainer.recipes import distillation, policy_gradient, supervised  # noqa: F401 (registers the catalog)
from stacx.trainer.recipes.blocks import policy_role, rl_recipe
from stacx.trainer.recipes.policy_gradient import REFERENCE_REFRESH_EVERY_N_STEPS

__all__ = ["REFERENCE_REFRESH_EVERY_N_STEPS", "TRAINING_CONFIGS", "get_recipe", "policy_role", "recipe", "rl_recipe"]
