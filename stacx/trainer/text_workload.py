"""The core's `text` workload: the driver and per-rank runtime that `stacx.trainer.config.workload` names
(`TEXT_WORKLOAD`) for LLM recipes, as `stacx.diffusion.workload` gives the `image` workload's."""

from __future__ import annotations

from typing import Any


class TextDriver:
    """One run of a text recipe: `run_training` (SPMD under torchrun, Ray role workers otherwise)."""

    def __init__(self, run_config, recipe):
        self.run_config = run_config
        self.recipe = recipe

    def describe(self) -> str:
        """The recipe, its roles and syncs (`stacx train --dry-run` adds the placement and the settings)."""
        return self.recipe.describe()

    def run(self) -> dict[str, Any]:
        # Imported here: `run_training` pulls in the loop, Ray and megatron-core (start-up time).
        from stacx.trainer import run_training

        return run_training(self.run_config)


def text_runtime(role, run_config, algorithm, groups, *, rank: int):
    """One rank's `RoleRuntime` of `role`, as a role worker builds it."""
    # Imported here: the runtime imports megatron-core (start-up time).
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    return RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                       train=run_config.train, rank=rank)
