"""Stacx: reinforcement learning and distillation post-training on megatron-core."""

from stacx.backend_warnings import silence_expected_backend_warnings

__version__ = "0.1.0"

silence_expected_backend_warnings()
