"""The run's configuration data model: run config sections, algorithm config, the recipe model and its resolution.

    from stacx.trainer.config import TrainingConfig, ModelRole, InjectSync, ExchangeSync, StacxConfig

(`from stacx import ...` offers the same names and the `recipe` decorator, which cannot live here:
`stacx.trainer.config.recipe` is the module that defines the recipe model.)
"""

from importlib import import_module

_PUBLIC = {
    "TrainingConfig": "stacx.trainer.config.recipe",
    "ModelRole": "stacx.trainer.config.recipe",
    "InjectSync": "stacx.trainer.config.recipe",
    "ExchangeSync": "stacx.trainer.config.recipe",
    "RunConfig": "stacx.trainer.config.run",
    "StacxConfig": "stacx.trainer.config.python",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'stacx.trainer.config' has no attribute {name!r}")
