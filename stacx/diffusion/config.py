"""`DiffusionModelConfig`: everything needed to build a diffusion model from scratch (no download).

The image path is pixel space: an image of `image_size` x `image_size` pixels with
`num_channels` channels in [-1, 1] is the model's latent, so small models run on CPU. (A latent
path would put a VAE in front; the samplers and losses take any latent shape unchanged.)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

MODEL_FAMILIES = ("dit", "mmdit")
"""`dit`: diffusers' DiTTransformer2DModel (class labels, adaLN-zero); `mmdit`: SD3Transformer2DModel
(joint text-image attention)."""
CONDITIONERS = ("label", "text")
"""`label`: each prompt of a fixed list is one class; `text`: a learned word embedding of the prompt."""
FAMILY_CONDITIONERS = {"dit": ("label",), "mmdit": ("text",)}
"""Conditioners each family accepts (DiT takes class labels, MMDiT takes token states + a pooled vector)."""


class DiffusionConfigError(ValueError):
    """A diffusion model config is malformed; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class DiffusionModelConfig:
    """A DiT or MMDiT transformer over pixels, and the conditioner that turns prompts into its input."""

    family: str = "mmdit"
    """Transformer family: 'dit' or 'mmdit' (see MODEL_FAMILIES)."""
    conditioner: str = "text"
    """'label' (with family 'dit') or 'text' (with family 'mmdit')."""
    image_size: int = 16
    """Height and width in pixels; a multiple of patch_size."""
    num_channels: int = 3
    """Image channels (3: RGB in [-1, 1])."""
    patch_size: int = 2
    """Side of the square patches the transformer attends over."""
    num_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 2
    """Attention heads per block."""
    attention_head_dim: int = 16
    """Width of one head; the model width is heads x head_dim."""
    vocabulary: tuple[str, ...] = ()
    """'text': the known words (others map to an unknown-word token); 'label': the prompts, one class each."""
    text_dim: int = 32
    """'text': width of the word embeddings (the MMDiT's joint_attention_dim and pooled_projection_dim)."""
    max_prompt_words: int = 8
    """'text': prompts are cut or padded to this many words."""

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise DiffusionConfigError(f"diffusion model config: field 'family' is {self.family!r}; known: "
                                       f"{', '.join(MODEL_FAMILIES)}")
        if self.conditioner not in CONDITIONERS:
            raise DiffusionConfigError(f"diffusion model config: unknown conditioner {self.conditioner!r} (field "
                                       f"'conditioner'); known: {', '.join(CONDITIONERS)}")
        if self.conditioner not in FAMILY_CONDITIONERS[self.family]:
            raise DiffusionConfigError(
                f"diffusion model config: conditioner {self.conditioner!r} does not fit family {self.family!r}; use "
                f"conditioner={FAMILY_CONDITIONERS[self.family][0]!r}")
        for name in ("image_size", "num_channels", "patch_size", "num_layers", "num_attention_heads",
                     "attention_head_dim", "text_dim", "max_prompt_words"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DiffusionConfigError(f"diffusion model config: field {name!r} must be an integer >= 1, "
                                           f"got {value!r}")
        if self.image_size % self.patch_size:
            raise DiffusionConfigError(
                f"diffusion model config: image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}; the model cannot take it - use an image_size divisible by {self.patch_size}")
        if not self.vocabulary:
            raise DiffusionConfigError("diffusion model config: field 'vocabulary' is empty; give the words (text) "
                                       "or prompts (label) the conditioner knows")
        object.__setattr__(self, "vocabulary", tuple(self.vocabulary))

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """[C, H, W] of one sample."""
        return (self.num_channels, self.image_size, self.image_size)

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["vocabulary"] = list(self.vocabulary)
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "DiffusionModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DiffusionConfigError(f"diffusion model config: unknown fields {unknown}; known: {sorted(known)}")
        values = dict(values)
        if "vocabulary" in values:
            values["vocabulary"] = tuple(values["vocabulary"])
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
