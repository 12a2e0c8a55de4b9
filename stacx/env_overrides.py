"""Environment variables that override run-config fields of distillation recipes.

    STACX_DISTILL_KL_MODE       -> teacher.distill_kl_mode       k3_sample | topk
    STACX_DAGGER_SAMPLING_MODE  -> teacher.dagger_sampling_mode  beta | kappa
                                   (aliases mixture_dagger_opd -> beta, mixture_aggrevate_opd -> kappa)
    STACX_DAGGER_SFT_MODE       -> teacher.dagger_sft_mode       live | trajectory

docs/env-reference.md lists every variable Stacx reads. An unknown value raises, naming the
variable and the accepted values.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

ENV_OVERRIDES = {
    "STACX_DISTILL_KL_MODE": ("distill_kl_mode", {"k3_sample": "k3_sample", "topk": "topk"}),
    "STACX_DAGGER_SAMPLING_MODE": ("dagger_sampling_mode", {
        "beta": "beta", "kappa": "kappa", "mixture_dagger_opd": "beta", "mixture_aggrevate_opd": "kappa",
    }),
    "STACX_DAGGER_SFT_MODE": ("dagger_sft_mode", {"live": "live", "trajectory": "trajectory"}),
}


def read_env_overrides(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """{field name: value} for every override variable that is set (and non-empty)."""
    environ = os.environ if environ is None else environ
    overrides = {}
    for variable, (field_name, accepted) in ENV_OVERRIDES.items():
        raw = environ.get(variable, "").strip()
        if not raw:
            continue
        if raw not in accepted:
            raise ValueError(f"environment variable {variable}={raw!r} is not one of {sorted(accepted)}")
        overrides[field_name] = accepted[raw]
    return overrides


def apply_env_overrides(section, environ: Optional[Mapping[str, str]] = None):
    """A copy of a frozen config section (e.g. RunConfig.teacher) with the env overrides applied."""
    overrides = read_env_overrides(environ)
    names = {f.name for f in dataclasses.fields(section)}
    missing = sorted(set(overrides) - names)
    if missing:
        raise ValueError(f"{type(section).__name__} has no fields {missing} to override from the environment")
    return dataclasses.replace(section, **overrides) if overrides else section
