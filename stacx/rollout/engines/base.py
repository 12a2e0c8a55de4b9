"""The one interface every inference engine implements (CPU in-process, HTTP, SGLang).

The rollout driver only talks to this interface, so the same loop drives a laptop CPU engine
and an SGLang fleet:

    outputs = engine.generate(requests)            # list[GenerateOutput], same order
    engine.update_weights(buckets, version=step)   # buckets of (hf_name, tensor)
    assert engine.weight_version() == step
"""

from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from stacx.rollout.types import GenerateOutput, GenerateRequest

WeightBucket = Sequence[tuple[str, torch.Tensor]]
"""A list of (Hugging Face parameter name, full unsharded tensor)."""


class InferenceEngine(abc.ABC):
    """Generation with per-token log-probs, weight updates, and lifecycle control."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Continue each request; outputs are returned in request order."""

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Load every (hf_name, tensor) of every bucket, then serve weights tagged `version`."""

    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights the engine serves now (0 = as loaded)."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop admitting new generation requests (in-flight ones finish first)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Admit generation requests again."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached prefixes (they were computed with older weights)."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve a request now."""

    def shutdown(self) -> None:
        """Release the engine's resources (servers, processes). Idempotent."""
