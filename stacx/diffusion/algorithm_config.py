"""`DiffusionAlgorithmConfig`: the `AlgorithmConfig` of a diffusion run, with the sampler, data and loss
knobs the LLM recipes do not have declared as fields (type, one default, a docstring each).

Each diffusion recipe declares its defaults as its `algorithm` (`stacx.diffusion.recipes`); a run
overrides any of them with `--algorithm-param NAME=VALUE` (or `algorithm: {NAME: VALUE}` in YAML).
`resolve_diffusion_algorithm` layers them like the LLM recipes' settings: declared defaults < the
recipe's < the user's.

Names mean one thing: Diffusion-DPO's beta is `diffusion_dpo_beta` (its errors are means over pixels,
so it is ~1000x an LLM's `dpo_beta`, which the diffusion recipes do not read and refuse when given).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from stacx.objectives.algorithm_config import (
    ALGORITHM_DEFAULTS,
    AlgorithmConfig,
    AlgorithmConfigError,
    hyperparameter_fields,
    scalar_type,
)
from stacx.objectives.diffusion_loss import SIGMA_SCHEDULES
from stacx.trainer.config.resolve import resolve_algorithm_config

MODEL_FAMILIES = ("mmdit", "dit")
"""Families of a model built from scratch: SD3-style MMDiT (text conditioner) or DiT (label conditioner)."""


@dataclass(frozen=True, kw_only=True)
class DiffusionAlgorithmConfig(AlgorithmConfig):
    """The algorithm section of a diffusion run: every `AlgorithmConfig` knob plus the diffusion ones."""

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
    diffusion_dpo_beta: float = 100.0
    """Diffusion-DPO's beta (larger than an LLM's `dpo_beta`: the errors it scales are means over pixels)."""
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
        super().__post_init__()
        for f in diffusion_fields():
            object.__setattr__(self, f.name, _checked(f, getattr(self, f.name)))
        if self.sde_sigma_schedule not in SIGMA_SCHEDULES:
            _refuse("sde_sigma_schedule", f"{self.sde_sigma_schedule!r} is unknown; known: {', '.join(SIGMA_SCHEDULES)}")
        if self.model_family not in MODEL_FAMILIES:
            _refuse("model_family", f"{self.model_family!r} is unknown; known: {', '.join(MODEL_FAMILIES)}")
        for name in ("num_inference_steps", "micro_batch_size", "image_size", "num_layers", "sde_window_shift_every",
                     "sde_window_stride"):
            if getattr(self, name) < 1:
                _refuse(name, f"must be >= 1, got {getattr(self, name)!r}")
        for name in ("sde_eta", "nft_beta", "diffusion_dpo_beta", "data_color_noise", "data_max_offset"):
            if getattr(self, name) < 0:
                _refuse(name, f"must be >= 0, got {getattr(self, name)!r}")
        if self.nft_advantage_clip <= 0:
            _refuse("nft_advantage_clip", f"must be > 0, got {self.nft_advantage_clip!r}")
        if self.sde_window_size and not 1 <= self.sde_window_size <= self.num_inference_steps - 1:
            _refuse("sde_window_size", f"{self.sde_window_size} must be in [1, num_inference_steps - 1 = "
                                       f"{self.num_inference_steps - 1}] (0: no window)")

    def __reduce__(self):
        # The base rebuilds an AlgorithmConfig; a diffusion config stays one (Ray workers).
        return (_rebuild, (self.to_dict(), tuple(sorted(self.given_keys))))

    @classmethod
    def from_values(cls, values: Mapping[str, Any], *, given_keys=None) -> "DiffusionAlgorithmConfig":
        """Known keys (the AlgorithmConfig and diffusion fields) become fields, the others `extras`. A
        diffusion value given as text (`--algorithm-param sde_eta=0.3`) is converted to the field's type;
        a custom key one letter off a diffusion field is refused with the field's name."""
        diffusion = {f.name: f for f in diffusion_fields()}
        known, extras = {}, {}
        for key, value in values.items():
            if key in diffusion:
                known[key] = _from_text(diffusion[key], value)
            elif key in ALGORITHM_DEFAULTS:
                known[key] = value
            else:
                close = difflib.get_close_matches(key, list(diffusion), n=1, cutoff=0.85)
                if close:
                    raise AlgorithmConfigError(f"--algorithm-param {key}: not a diffusion setting; "
                                               f"did you mean {close[0]!r}?")
                extras[key] = value
        given = frozenset(values) if given_keys is None else frozenset(given_keys)
        return cls(**known, extras=extras, given_keys=given)

    def to_dict(self) -> dict[str, Any]:
        """Every hyperparameter (diffusion ones included) and custom key as one flat dict."""
        return {**super().to_dict(), **self.diffusion_values()}

    def diffusion_values(self) -> dict[str, Any]:
        """The diffusion fields only (what `--dry-run` shows as the run's diffusion settings)."""
        return {f.name: getattr(self, f.name) for f in diffusion_fields()}


def diffusion_fields() -> tuple[dataclasses.Field, ...]:
    """The fields `DiffusionAlgorithmConfig` adds to `AlgorithmConfig`."""
    base = {f.name for f in hyperparameter_fields()}
    return tuple(f for f in hyperparameter_fields(DiffusionAlgorithmConfig) if f.name not in base)


def _refuse(name: str, message: str) -> None:
    raise AlgorithmConfigError(f"algorithm.{name} {message} (--algorithm-param {name}=...)")


def _checked(f: dataclasses.Field, value: Any) -> Any:
    base = scalar_type(f)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise AlgorithmConfigError(f"algorithm.{f.name} expects {base.__name__}, got {type(value).__name__} {value!r}")


def _from_text(f: dataclasses.Field, value: Any) -> Any:
    """A command-line value (text) as the field's type; other values are checked by the constructor."""
    if not isinstance(value, str):
        return value
    base = scalar_type(f)
    try:
        if base is bool:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        return base(value)
    except ValueError:
        raise AlgorithmConfigError(f"algorithm.{f.name} expects {base.__name__}, got {value!r} "
                                   f"(--algorithm-param {f.name}=...)") from None


def _rebuild(values: dict[str, Any], given_keys: tuple[str, ...]) -> DiffusionAlgorithmConfig:
    return DiffusionAlgorithmConfig.from_values(values, given_keys=given_keys)


def diffusion_algorithm(**overrides: Any) -> DiffusionAlgorithmConfig:
    """A diffusion recipe's declared algorithm: the defaults with `overrides` laid over them, checked now
    (a name that is no field is refused, with the closest one)."""
    known = [f.name for f in hyperparameter_fields(DiffusionAlgorithmConfig)]
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise AlgorithmConfigError(f"algorithm.{key} is not a diffusion algorithm field"
                                       + (f"; did you mean {close[0]!r}?" if close else ""))
    return DiffusionAlgorithmConfig.from_values(overrides, given_keys=())


def resolve_diffusion_algorithm(recipe, run_config) -> DiffusionAlgorithmConfig:
    """The run's diffusion algorithm: the declared defaults < the recipe's < the user's (file, flags,
    --algorithm-param), the way `resolve_algorithm_config` layers an LLM run's; `--reward-fn`, when
    given, sets `image_reward`. The LLM's `dpo_beta`, given to a diffusion recipe, is refused with
    the name the diffusion recipes read."""
    given = run_config.algorithm.given_keys
    if "dpo_beta" in given:
        raise AlgorithmConfigError(
            f"algorithm.dpo_beta is the LLM DPO beta; the diffusion recipe {recipe.name} reads diffusion_dpo_beta "
            "(--algorithm-param diffusion_dpo_beta=VALUE, default 100.0)")
    algorithm = resolve_algorithm_config(recipe, run_config)
    config = DiffusionAlgorithmConfig.from_values(algorithm.to_dict(), given_keys=algorithm.given_keys)
    if "reward_fn" in run_config.given_keys:
        config = dataclasses.replace(config, image_reward=run_config.rollout.reward_fn)
    return config


__all__ = ["DiffusionAlgorithmConfig", "MODEL_FAMILIES", "diffusion_algorithm", "diffusion_fields",
           "resolve_diffusion_algorithm"]
