"""The built-in prompt set, "a <colour> <shape>", and its target renderer (no download).

Images are RGB in [-1, 1] on a black background (-1). `render_target` draws the shape named by
the prompt in its colour; it makes the SFT images and the DPO pairs of the built-in data, and
the masks the shape reward compares with.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from stacx.diffusion.conditioning import prompt_words

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0),
    "yellow": (1.0, 1.0, -1.0), "cyan": (-1.0, 1.0, 1.0), "magenta": (1.0, -1.0, 1.0),
    "white": (1.0, 1.0, 1.0), "orange": (1.0, 0.0, -1.0),
}
"""Colour word -> RGB in [-1, 1]."""
SHAPES = ("square", "circle", "triangle")

ALL_PROMPTS = tuple(f"a {color} {shape}" for color, shape in itertools.product(COLORS, SHAPES))
HELD_OUT_PROMPTS = ("a red triangle", "a green square", "a blue circle", "a white triangle")
"""Never trained on by the built-in data: the demo's held-out reward is measured on these."""
TRAIN_PROMPTS = tuple(p for p in ALL_PROMPTS if p not in HELD_OUT_PROMPTS)
VOCABULARY = ("a", *COLORS, *SHAPES)
"""The words of the built-in prompts (the text conditioner's vocabulary)."""


def parse_prompt(prompt: str) -> tuple[str, str]:
    """(colour, shape) named in `prompt`; ValueError naming the prompt and the known words otherwise."""
    words = prompt_words(prompt)
    color = next((w for w in words if w in COLORS), None)
    shape = next((w for w in words if w in SHAPES), None)
    if color is None or shape is None:
        raise ValueError(f"prompt {prompt!r} names no {'colour' if color is None else 'shape'}; the built-in image "
                         f"rewards need one of the colours {', '.join(COLORS)} and one of the shapes "
                         f"{', '.join(SHAPES)}")
    return color, shape


def shape_mask(shape: str, size: int, offset: tuple[float, float] = (0.0, 0.0)) -> torch.Tensor:
    """[size, size] float mask (1 inside) of `shape` on pixel centres in [-1, 1] (y up)."""
    centres = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2.0 - 1.0
    y = -centres.view(-1, 1) - offset[1]
    x = centres.view(1, -1) - offset[0]
    if shape == "square":
        inside = (x.abs() < 0.55) & (y.abs() < 0.55)
    elif shape == "circle":
        inside = x ** 2 + y ** 2 < 0.62 ** 2
    elif shape == "triangle":
        inside = (y >= -0.55) & (x.abs() <= (0.65 - y) / 2.0)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return inside.to(torch.float32)


def render_target(prompt: str, size: int, *, generator: torch.Generator | None = None, color_noise: float = 0.0,
                  max_offset: float = 0.0, color: str | None = None, color_scale: float = 1.0) -> torch.Tensor:
    """[3, size, size] image of the prompt's shape in its colour (or `color`), on black.

    `color_scale`: the RGB colour is multiplied by this (< 1: washed out toward grey);
    `color_noise`: std of a Gaussian added to the RGB colour (clamped to [-1, 1]);
    `max_offset`: the shape is shifted by up to this much (in [-1, 1] units) in x and y.
    """
    prompt_color, shape = parse_prompt(prompt)
    rgb = torch.tensor(COLORS[color or prompt_color]) * color_scale
    if color_noise > 0:
        rgb = (rgb + color_noise * torch.randn(3, generator=generator)).clamp(-1.0, 1.0)
    offset = (0.0, 0.0)
    if max_offset > 0:
        offset = tuple(float(v) for v in (torch.rand(2, generator=generator) * 2 - 1) * max_offset)
    mask = shape_mask(shape, size, offset)
    return -1.0 + mask.unsqueeze(0) * (rgb.view(3, 1, 1) + 1.0)


def render_batch(prompts: Sequence[str], size: int, **kwargs) -> torch.Tensor:
    """[B, 3, size, size] targets of `prompts` (see `render_target`)."""
    return torch.stack([render_target(p, size, **kwargs) for p in prompts])
