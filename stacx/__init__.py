"""Stacx: reinforcement learning and distillation post-training on megatron-core."""

from stacx.backend_warnings import silence_expected_backend_warnings

__version__ = "0.1.0"

silence_expected_backend_warnings()


def __getattr__(name: str):
    # `from stacx import StacxConfig` without importing the trainer at `import stacx`.
    if name == "StacxConfig":
        from stacx.trainer.config.python import StacxConfig

        return StacxConfig
    raise AttributeError(f"module 'stacx' has no attribute {name!r}")
