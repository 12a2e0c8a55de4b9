"""`DiffusionSettings`: the sampler, data and loss knobs of a diffusion run that the LLM run config
does not have. Each diffusion recipe declares its defaults (`stacx.diffusion.recipes`); a run
overrides any of them with `--algorithm-param NAME=VALUE` (or `algorithm: {NAME: VALUE}` in YAML).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from stacx.objectives.diffusion_loss import SIGMA_SCHEDULES

KINDS = ("sft", "grpo", "dpo", "nft")
"""How a step trains: flow-matching regression on data, the clipped policy loss over SDE steps,
preference pairs, or forward-process RL on the policy's own clean samples."""


@dataclass(frozen=True, kw_only=True)
class DiffusionSettings:
    """Knobs of a diffusion run (defaults per recipe; `--algorithm-param NAME=VALUE` overrides)."""

    kind: str
    """Which training step the recipe runs: sft, grpo, dpo or nft (set by the recipe, not by users)."""
    num_inference_steps: int = 6
    """Denoising steps K of the samplers (time grid t_k = 1 - k / K)."""
    sde_eta: float = 0.7
    """eta of the SDE steps' sigma_t (0: every step is an ODE step)."""
    sde_sigma_schedule: str = "flow_grpo"
    """sigma_t rule: 'flow_grpo' (eta sqrt(t / (1 - t))) or 'dance_grpo' (eta)."""
    sde_window_size: int = 0
    """MixGRPO: number of consecutive SDE steps per training step (0: every step but the last is SDE)."""
    sde_window_shift_every: int = 1
    """MixGRPO: training steps between two moves of the window."""
    sde_window_stride: int = 1
    """MixGRPO: denoising steps the window moves by."""
    shared_group_noise: bool = False
    """Every sample of a prompt's group starts from the same initial noise (DanceGRPO, MixGRPO)."""
    nft_beta: float = 1.0
    """DiffusionNFT: strength beta of the implicit positive / negative policies."""
    nft_advantage_clip: float = 2.0
    """DiffusionNFT: advantages are divided by this and clipped to [-1, 1] into the optimality r."""
    dpo_beta: float = 100.0
    """Diffusion-DPO's beta (larger than an LLM's: the errors it scales are means over pixels)."""
    micro_batch_size: int = 8
    """Samples per forward / backward pass on a worker."""
    image_reward: str = "color_shape"
    """Image reward of the RL recipes (stacx.diffusion.rewards); --reward-fn, when given, wins."""
    data_color_noise: float = 0.35
    """Built-in SFT / DPO data: std of the noise on each target image's colour."""
    data_color_scale: float = 1.0
    """Built-in SFT / DPO data: the named colour is multiplied by this (< 1: a washed-out dataset)."""
    data_max_offset: float = 0.1
    """Built-in SFT / DPO data: largest shift of the drawn shape (image units, [-1, 1] span)."""
    image_size: int = 16
    """Side of the images of a model built from scratch (no --hf-checkpoint)."""
    model_family: str = "mmdit"
    """Family of a model built from scratch: 'mmdit' (text conditioner) or 'dit' (label conditioner)."""
    num_layers: int = 2
    """Transformer blocks of a model built from scratch."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"diffusion settings: field 'kind' is {self.kind!r}; known: {', '.join(KINDS)}")
        if self.sde_sigma_schedule not in SIGMA_SCHEDULES:
            raise ValueError(f"diffusion settings: sde_sigma_schedule {self.sde_sigma_schedule!r} is unknown; known: "
                             f"{', '.join(SIGMA_SCHEDULES)} (--algorithm-param sde_sigma_schedule=...)")
        for name in ("num_inference_steps", "micro_batch_size", "image_size", "num_layers", "sde_window_shift_every",
                     "sde_window_stride"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"diffusion settings: {name} must be >= 1, got {getattr(self, name)!r} "
                                 f"(--algorithm-param {name}=...)")
        if self.sde_eta < 0:
            raise ValueError(f"diffusion settings: sde_eta must be >= 0, got {self.sde_eta}")
        if self.sde_window_size and not 1 <= self.sde_window_size <= self.num_inference_steps - 1:
            raise ValueError(f"diffusion settings: sde_window_size {self.sde_window_size} must be in "
                             f"[1, num_inference_steps - 1 = {self.num_inference_steps - 1}] (0: no window)")

    def with_overrides(self, values: Mapping[str, Any]) -> "DiffusionSettings":
        """These settings with `values` (e.g. the run's --algorithm-param extras) laid over them;
        names that are not settings are ignored (they may be custom kernel hyperparameters)."""
        known = {f.name: f for f in dataclasses.fields(self) if f.name != "kind"}
        updates = {}
        for name, value in values.items():
            if name in known:
                kind = type(getattr(self, name))
                updates[name] = kind(value) if kind in (int, float, str) else (
                    value if not isinstance(value, str) else value.lower() in ("1", "true", "yes"))
            else:
                close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.85)
                if close:
                    raise ValueError(f"--algorithm-param {name}: not a diffusion setting; did you mean {close[0]!r}?")
        return dataclasses.replace(self, **updates)
