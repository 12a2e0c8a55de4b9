"""Shape checks for per-trajectory tensor lists, with errors naming argument and trajectory."""

from __future__ import annotations

from typing import Sequence

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig, as_algorithm_config


def check_trajectory_lists(reference_name: str, reference: Sequence[torch.Tensor], **others) -> list[int]:
    """Check that every list holds 1-D tensors matching `reference` trajectory by trajectory.

    `others` maps argument names to lists (None entries are skipped). Returns the response
    lengths. Raises `ValueError` naming the argument and the trajectory index on a mismatch.
    """
    if not isinstance(reference, (list, tuple)):
        raise ValueError(f"{reference_name} must be a list of per-trajectory tensors, got {type(reference).__name__}")
    lengths = []
    for index, tensor in enumerate(reference):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{reference_name}[{index}] must be a 1-D tensor, got {shape}")
        lengths.append(tensor.shape[0])
    for name, values in others.items():
        if values is None:
            continue
        if not isinstance(values, (list, tuple)):
            raise ValueError(f"{name} must be a list of per-trajectory tensors, got {type(values).__name__}")
        if len(values) != len(reference):
            raise ValueError(
                f"{name} has {len(values)} trajectories but {reference_name} has {len(reference)}"
            )
        for index, (tensor, length) in enumerate(zip(values, lengths)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name}[{index}] must be a 1-D tensor, got {shape}")
            if tensor.shape[0] != length:
                raise ValueError(
                    f"{name}[{index}] has length {tensor.shape[0]} but {reference_name}[{index}] "
                    f"has length {length}"
                )
    return lengths


def check_scalars_per_trajectory(name: str, values, num_trajectories: int) -> torch.Tensor:
    """One scalar per trajectory (list of numbers or a 1-D tensor) -> float64-safe 1-D tensor."""
    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(list(values), dtype=torch.float32)
    if tensor.dim() != 1 or tensor.shape[0] != num_trajectories:
        raise ValueError(
            f"{name} must hold one scalar per trajectory ({num_trajectories}), got shape {tuple(tensor.shape)}"
        )
    return tensor


def hyperparameter(config: AlgorithmConfig | None, name: str):
    """`config.<name>` of an `AlgorithmConfig` (None: the declared defaults), for code that reads a knob
    by a name held in a string (a plugin's declared knobs); kernels read `config.<name>` directly. A
    config of any other type is refused (`as_algorithm_config`); a name that is neither a declared
    hyperparameter nor a custom key of `config` raises AttributeError listing both."""
    return getattr(as_algorithm_config(config, f"hyperparameter(config, {name!r})"), name)


def split_like(flat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Split a concatenated (sum(lengths),) tensor back into per-trajectory views."""
    return list(flat.split(list(lengths)))


def rollout_field(rollout_data, name: str, *, required: bool = True):
    """`rollout_data[name]` (a mapping) or `rollout_data.name` (an object); None if optional and absent."""
    if isinstance(rollout_data, dict) or hasattr(rollout_data, "keys"):
        value = rollout_data.get(name) if hasattr(rollout_data, "get") else None
    else:
        value = getattr(rollout_data, name, None)
    if value is None and required:
        raise ValueError(f"rollout_data has no field {name!r}, which this advantage estimator needs")
    return value
