"""`DiffusionModel`: a diffusers transformer (DiT or SD3-style MMDiT) plus its conditioner, predicting
the flow-matching velocity v_theta(x_t, t, prompt). Built from a `DiffusionModelConfig`; no weights
are downloaded.

The transformer is kept in eval mode: diffusers' DiT label embedding drops labels at random in
training mode (for classifier-free guidance), which would make a step depend on the sampler's
luck instead of the data; gradients do not need training mode.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from stacx.diffusion.conditioning import build_conditioner
from stacx.diffusion.config import DiffusionConfigError, DiffusionModelConfig

TIMESTEP_SCALE = 1000.0
"""diffusers' transformers embed timesteps in [0, 1000] (SD3's pipeline passes sigma * 1000)."""


def build_transformer(config: DiffusionModelConfig) -> nn.Module:
    """The diffusers transformer of `config.family`, randomly initialized."""
    common = dict(num_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                  attention_head_dim=config.attention_head_dim, in_channels=config.num_channels,
                  out_channels=config.num_channels, sample_size=config.image_size, patch_size=config.patch_size)
    if config.family == "dit":
        from diffusers import DiTTransformer2DModel

        return DiTTransformer2DModel(num_embeds_ada_norm=len(config.vocabulary), norm_type="ada_norm_zero", **common)
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(joint_attention_dim=config.text_dim, pooled_projection_dim=config.text_dim,
                                 caption_projection_dim=config.num_attention_heads * config.attention_head_dim,
                                 pos_embed_max_size=config.image_size // config.patch_size, **common)


class DiffusionModel(nn.Module):
    """transformer + conditioner: `velocity(x_t, t, conditioning)`, `encode(prompts)`."""

    def __init__(self, config: DiffusionModelConfig, transformer: nn.Module | None = None,
                 conditioner: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.transformer = transformer if transformer is not None else build_transformer(config)
        self.conditioner = conditioner if conditioner is not None else build_conditioner(config)
        self.transformer.eval()

    def train(self, mode: bool = True) -> "DiffusionModel":  # noqa: D102 - see the module docstring
        super().train(mode)
        self.transformer.eval()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Conditioning tensors of a batch of prompts on the model's device (carry gradients into the conditioner)."""
        return {name: value.to(self.device) for name, value in self.conditioner(list(prompts)).items()}

    def check_latents(self, latents_BCHW: torch.Tensor) -> None:
        expected = self.config.latent_shape
        if latents_BCHW.dim() != 4 or tuple(latents_BCHW.shape[1:]) != expected:
            raise DiffusionConfigError(
                f"the model takes images of shape [B, {expected[0]}, {expected[1]}, {expected[2]}] (image_size "
                f"{self.config.image_size}, {self.config.num_channels} channels), got {tuple(latents_BCHW.shape)}; "
                f"resize the images or build the model with image_size={latents_BCHW.shape[-1]}")

    def velocity(self, latents_BCHW: torch.Tensor, t_B: torch.Tensor, conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        """v_theta(x_t, t, c) [B, C, H, W]; t in [0, 1] (1: noise)."""
        self.check_latents(latents_BCHW)
        timestep_B = (t_B.to(device=latents_BCHW.device, dtype=latents_BCHW.dtype) * TIMESTEP_SCALE).expand(
            latents_BCHW.shape[0])
        return self.transformer(latents_BCHW, timestep=timestep_B, return_dict=False, **conditioning)[0]

    def forward(self, latents_BCHW, t_B, prompts: Sequence[str]) -> torch.Tensor:
        return self.velocity(latents_BCHW, t_B, self.encode(prompts))
