"""The run's configuration data model: run config sections, algorithm config, the recipe model and its resolution.

    from stacx.trainer.config import TrainingConfig, ModelRole, InjectSync, ExchangeSync, StacxConfig

(`from stacx import ...` offers the same names and the `recipe` decorator, which cannot live here:
`stacx.trainer.config.recipe` is the module that defines the recipe model.)
"""

from stacx.lazy_names import lazy_names

_EXPORTS = {
    "stacx.trainer.config.recipe": ("TrainingConfig", "ModelRole", "InjectSync", "ExchangeSync"),
    "stacx.trainer.config.run": ("RunConfig",),
    "stacx.trainer.config.python": ("StacxConfig",),
}

__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())
