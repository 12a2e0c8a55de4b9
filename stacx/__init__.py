"""Stacx: reinforcement learning and distillation post-training on megatron-core."""

__version__ = "0.1.0"
