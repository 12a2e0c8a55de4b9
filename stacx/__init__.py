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

_PUBLIC = {
    "recipe": "stacx.trainer.config.recipe",
    "TrainingConfig": "stacx.trainer.config.recipe",
    "ModelRole": "stacx.trainer.config.recipe",
    "InjectSync": "stacx.trainer.config.recipe",
    "ExchangeSync": "stacx.trainer.config.recipe",
    "register_advantage": "stacx.objectives.registry",
    "register_policy_loss": "stacx.objectives.registry",
    "register_reward": "stacx.rollout.rewards",
    "register_engine": "stacx.rollout.engines.registry",
    "Environment": "stacx.rollout.environments",
    "StepResult": "stacx.rollout.environments",
    "register_environment": "stacx.rollout.environments",
    "register_tool": "stacx.rollout.tools",
    "StacxConfig": "stacx.trainer.config.python",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
