"""The run's configuration data model: run config sections, algorithm config, the recipe model and its resolution.

    from stacx.trainer.config import TrainingConfig, ModelRole, InjectSync, ExchangeSync, StacxConfig

(`from stacx import ...` offers the same names and the `recipe` decorator, which cannot live here:
`stacx.trainer.config.recipe` is the module that defines the recipe model.)
"""

from stacx.lazy_names import lazy_names

_PUBLIC = {
    "TrainingConfig": "stacx.trainer.config.recipe",
    "ModelRole": "stacx.trainer.config.recipe",
    "InjectSync": "stacx.trainer.config.recipe",
    "ExchangeSync": "stacx.trainer.config.recipe",
    "RunConfig": "stacx.trainer.config.run",
    "StacxConfig": "stacx.trainer.config.python",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
