"""The `image` workload: the diffusion recipes' driver loop and per-rank runtime, registered in the
core's workload registry (`stacx.trainer.config.workload`) before the recipes that name it.

`stacx.launch.workloads` imports this module's package entry (`stacx.diffusion.recipes`, which
imports this module first); the core never imports `stacx.diffusion`.
"""

from __future__ import annotations

from stacx.diffusion.loop import DiffusionDriver
from stacx.diffusion.objective import DiffusionObjective
from stacx.diffusion.runtime import DiffusionRuntime
from stacx.trainer.config.workload import Workload, register_workload

IMAGE_MODALITY = "image"

IMAGE_WORKLOAD = register_workload(Workload(
    modality=IMAGE_MODALITY,
    description="experimental flow-matching image models (stacx.diffusion)",
    driver=DiffusionDriver,
    objective_base=DiffusionObjective,
    runtime=DiffusionRuntime,
))
"""The registered `image` workload."""
