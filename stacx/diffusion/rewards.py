"""Image rewards: `fn(images [B, C, H, W] in [-1, 1], prompts) -> [B] float` in a registry, so a user
adds one the way they add a loss kernel:

    from stacx.diffusion.rewards import register_image_reward

    @register_image_reward("brightness")
    def brightness(images, prompts):
        return images.mean(dim=(1, 2, 3))

Built in, both programmatic (no download), reading the colour and shape the prompt names
(`stacx.diffusion.prompts`):

- `color`: 1 - |m - c| / (2 sqrt(3)), with m the image's mean colour weighted by pixel brightness
  w = clamp((max_channel + 1) / 2, 0, 1) (the drawn part counts, the black background does not)
  and c the named colour; in [0, 1].
- `shape`: soft IoU between the brightness map w and the named shape's mask; in [0, 1].
- `color_shape`: the mean of the two.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from stacx.diffusion.prompts import COLORS, parse_prompt, shape_mask
from stacx.plugins.registry import Registry

IMAGE_REWARDS = Registry("image reward", user_may_replace_builtins=True)
"""Name -> fn(images [B, C, H, W], prompts) -> [B] rewards."""


def register_image_reward(name: str) -> Callable:
    return IMAGE_REWARDS.register(name)


def get_image_reward(name: str) -> Callable:
    if name not in IMAGE_REWARDS:
        raise ValueError(f"unknown image reward {name!r} (--reward-fn); registered image rewards: "
                         f"{', '.join(IMAGE_REWARDS.names())}")
    return IMAGE_REWARDS.get(name)


def _brightness(images_BCHW: torch.Tensor) -> torch.Tensor:
    return ((images_BCHW.amax(dim=1) + 1.0) / 2.0).clamp(0.0, 1.0)


@register_image_reward("color")
def color_reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """1 - |brightness-weighted mean colour - named colour| / (2 sqrt 3)."""
    images = images.detach().float().clamp(-1.0, 1.0)
    weights_BHW = _brightness(images)
    total_B = weights_BHW.sum(dim=(1, 2))
    mean_B3 = (images * weights_BHW.unsqueeze(1)).sum(dim=(2, 3)) / total_B.clamp_min(1e-6).unsqueeze(1)
    target_B3 = torch.tensor([COLORS[parse_prompt(p)[0]] for p in prompts])
    reward = 1.0 - (mean_B3 - target_B3).norm(dim=1) / (2.0 * math.sqrt(3.0))
    return torch.where(total_B > 1e-6, reward, torch.zeros_like(reward))


@register_image_reward("shape")
def shape_reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Soft IoU of the brightness map with the named shape's mask."""
    images = images.detach().float().clamp(-1.0, 1.0)
    weights_BHW = _brightness(images)
    masks_BHW = torch.stack([shape_mask(parse_prompt(p)[1], images.shape[-1]) for p in prompts])
    intersection = (weights_BHW * masks_BHW).sum(dim=(1, 2))
    union = (weights_BHW + masks_BHW - weights_BHW * masks_BHW).sum(dim=(1, 2))
    return intersection / union.clamp_min(1e-6)


@register_image_reward("color_shape")
def color_shape_reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Mean of `color` and `shape`."""
    return 0.5 * (color_reward(images, prompts) + shape_reward(images, prompts))
