"""Stacx: reinforcement learning and distillation post-training on megatron-core.

The public front door: everything a user writes a recipe, an objective or a run config with.

    from stacx import recipe, TrainingConfig, ModelRole, InjectSync, ExchangeSync
    from stacx import register_advantage, register_policy_loss, register_reward, register_engine, StacxConfig
    from stacx import Environment, StepResult, register_environment, register_tool   # agents (docs/agents.md)

Each name is imported on first use, so `import stacx` stays light (no torch, Ray or megatron-core).
"""

from stacx.backend_warnings import silence_expected_backend_warnings
from stacx.lazy_names import lazy_names

__version__ = "0.1.0"

silence_expected_backend_warnings()

_EXPORTS = {
    "stacx.trainer.config.recipe": ("recipe",),
    "stacx.trainer.config": ("TrainingConfig", "ModelRole", "InjectSync", "ExchangeSync", "StacxConfig"),
    "stacx.objectives.registry": ("register_advantage", "register_policy_loss"),
    "stacx.rollout.rewards": ("register_reward",),
    "stacx.rollout.engines.registry": ("register_engine",),
    "stacx.rollout.agents.environments": ("Environment", "StepResult", "register_environment"),
    "stacx.rollout.agents.tools": ("register_tool",),
}
"""Module -> the public names it gives (the run's config classes through `stacx.trainer.config`, which knows
where each is defined)."""

__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())
