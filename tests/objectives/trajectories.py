"""Random per-trajectory data for objective tests (float64 so references are exact)."""

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig


def random_lengths(generator: torch.Generator, num: int, low: int = 1, high: int = 7) -> list[int]:
    return torch.randint(low, high + 1, (num,), generator=generator).tolist()


def random_log_probs(generator: torch.Generator, lengths, scale: float = 1.0) -> list[torch.Tensor]:
    """Negative log-probs (real log-probs are <= 0)."""
    return [-(torch.rand(n, generator=generator, dtype=torch.float64) * 2.0 * scale + 0.01) for n in lengths]


def random_masks(generator: torch.Generator, lengths, keep: float = 0.8) -> list[torch.Tensor]:
    return [(torch.rand(n, generator=generator, dtype=torch.float64) < keep).to(torch.float64) for n in lengths]


def config(**values) -> AlgorithmConfig:
    """The kernels' config as a run builds it: the given knobs (custom ones in extras), recorded as set."""
    return AlgorithmConfig.from_values(values)
