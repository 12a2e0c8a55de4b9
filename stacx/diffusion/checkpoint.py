"""Save and load a `DiffusionModel` in the diffusers folder layout:

    <dir>/model_index.json                      components and their classes
    <dir>/transformer/config.json               diffusers' own save_pretrained
    <dir>/transformer/diffusion_pytorch_model.safetensors
    <dir>/scheduler/scheduler_config.json       FlowMatchEulerDiscreteScheduler (shift 1: the samplers' grid)
    <dir>/conditioner/config.json               the DiffusionModelConfig
    <dir>/conditioner/model.safetensors         the conditioner's tables

so `SD3Transformer2DModel.from_pretrained(<dir>, subfolder="transformer")` (or DiT's) loads the
transformer with diffusers alone.
"""

from __future__ import annotations

import json
import os

import torch

from stacx.diffusion.config import DiffusionConfigError, DiffusionModelConfig
from stacx.diffusion.models import DiffusionModel

MODEL_INDEX = "model_index.json"
TRANSFORMER_CLASSES = {"dit": "DiTTransformer2DModel", "mmdit": "SD3Transformer2DModel"}


def save_diffusion_model(model: DiffusionModel, path: str) -> str:
    """Write `model` under `path` (created) in the diffusers layout; returns `path`."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = model.config
    model.transformer.save_pretrained(os.path.join(path, "transformer"))
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(os.path.join(path, "scheduler"))
    conditioner_dir = os.path.join(path, "conditioner")
    os.makedirs(conditioner_dir, exist_ok=True)
    with open(os.path.join(conditioner_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    state = {k: v.detach().contiguous().cpu() for k, v in model.conditioner.state_dict().items()}
    save_file(state, os.path.join(conditioner_dir, "model.safetensors"))
    index = {"_class_name": "StacxFlowMatchingPipeline", "_diffusers_version": diffusers.__version__,
             "transformer": ["diffusers", TRANSFORMER_CLASSES[config.family]],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "conditioner": ["stacx", type(model.conditioner).__name__]}
    with open(os.path.join(path, MODEL_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return path


def is_diffusion_checkpoint(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, MODEL_INDEX)) and os.path.isdir(
        os.path.join(path, "conditioner"))


def load_diffusion_config(path: str) -> DiffusionModelConfig:
    if not is_diffusion_checkpoint(path):
        raise DiffusionConfigError(
            f"{path!r} is not a diffusion checkpoint (no {MODEL_INDEX} and conditioner/ folder); create one with "
            "stacx.diffusion.checkpoint.save_diffusion_model or `stacx demo --diffusion`")
    with open(os.path.join(path, "conditioner", "config.json")) as f:
        return DiffusionModelConfig.from_dict(json.load(f))


def load_diffusion_model(path: str) -> DiffusionModel:
    """The model saved under `path` by `save_diffusion_model`."""
    import diffusers
    from safetensors.torch import load_file

    config = load_diffusion_config(path)
    transformer_cls = getattr(diffusers, TRANSFORMER_CLASSES[config.family])
    transformer = transformer_cls.from_pretrained(os.path.join(path, "transformer"))
    model = DiffusionModel(config, transformer=transformer)
    model.conditioner.load_state_dict(load_file(os.path.join(path, "conditioner", "model.safetensors")))
    return model.to(torch.float32)
