"""The workload registry: what runs a recipe of each `TrainingConfig.modality`.

A recipe says what its policy generates (`modality`); every modality is a registered `Workload`,
the core's own `"text"` (LLM recipes: `StacxTrainer` over `RoleRuntime`s, registered below) like the
others:

    register_workload(Workload(modality="image", description="...", driver=DiffusionDriver,
                               objective_base=DiffusionObjective, runtime=DiffusionRuntime))

`stacx train` asks `get_workload(recipe.modality)` for the driver of every recipe, a text one included
(its driver runs the preflight when built, prints the placement for `--dry-run` and calls `run_training`);
a recipe naming a modality nobody registered fails at `@recipe` time, listing the registered ones. A package registers its
workload the way plugins are found: `stacx.launch.workloads` imports the built-in ones and the
`stacx.workloads` entry points of installed packages; a `stacx/custom/` or `--custom-module` file may
call `register_workload` itself. The core never imports a workload's package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from stacx.plugins.registry import ImportedOnCall, Registry
from stacx.specializations.base import Specialization

TEXT_MODALITY = "text"
"""The modality the core runs itself (LLM recipes: `StacxTrainer`, `RoleRuntime`)."""


class WorkloadDriver(Protocol):
    """The driver loop of one run of a workload, built from the run config and the recipe."""

    def describe(self) -> str:
        """What `stacx train --dry-run` prints: the recipe and the resolved settings; starts nothing."""
        ...

    def run(self) -> dict[str, Any]:
        """Train for the run's steps (start workers, loop, save, stop workers); the last step's metrics."""
        ...


@dataclass(frozen=True, kw_only=True)
class Workload:
    """How runs of one modality are driven and what each rank of their roles holds."""

    modality: str
    """The `TrainingConfig.modality` this workload runs (an identifier)."""
    description: str
    """One line for `stacx recipes` and error messages."""
    driver: Callable[..., WorkloadDriver]
    """`driver(run_config, recipe)`: the run's driver loop. Checks the configuration (ValueError naming the
    flag) and starts nothing until `run()`."""
    objective_base: type
    """The class every role's `specialization_cls` of this modality's recipes subclasses (checked at `@recipe`)."""
    runtime: Callable[..., Any]
    """`runtime(role, run_config, algorithm, groups, rank=...)`: one rank's runtime of a role, what a role
    worker holds (the core's equivalent is `RoleRuntime`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.modality, str) or not self.modality.isidentifier():
            raise ValueError(f"Workload.modality must be an identifier, got {self.modality!r}")
        if not isinstance(self.objective_base, type):
            raise ValueError(f"workload {self.modality!r}: field 'objective_base' must be a class, "
                             f"got {self.objective_base!r}")
        for name in ("driver", "runtime"):
            if not callable(getattr(self, name)):
                raise ValueError(f"workload {self.modality!r}: field {name!r} must be callable, "
                                 f"got {getattr(self, name)!r}")


WORKLOADS: Registry[Workload] = Registry("workload", entries_are_callable=False, same_entry_again_is_noop=True,
                                         known_as="registered modalities")
"""modality -> its registered Workload (a `stacx.plugins.registry.Registry`)."""


def register_workload(workload: Workload) -> Workload:
    """Register `workload` under its modality. Registering the same workload again is a no-op (a module
    imported twice); another workload under a taken modality is refused, naming both."""
    if not isinstance(workload, Workload):
        raise TypeError(f"register_workload expects a Workload, got {type(workload).__name__}")
    return WORKLOADS.add(workload.modality, workload, origin=workload.driver)


def unregister_workload(modality: str) -> None:
    """Remove a registered workload (tests that register a toy one clean up with this)."""
    WORKLOADS.pop(modality, None)


def known_modalities() -> tuple[str, ...]:
    """'text' and every other registered workload's modality."""
    return (TEXT_MODALITY, *(name for name in WORKLOADS.names() if name != TEXT_MODALITY))


def get_workload(modality: str) -> Workload:
    """The workload registered for `modality`; ValueError listing the registered ones otherwise."""
    try:
        return WORKLOADS.get(modality)
    except ValueError as err:
        raise ValueError(f"{err}. Install or load the package that registers it (a `stacx.workloads` entry point, "
                         "stacx/custom/, or --custom-module)") from None


TEXT_WORKLOAD = register_workload(Workload(
    modality=TEXT_MODALITY,
    description="LLM recipes: StacxTrainer over RoleRuntimes (the core)",
    driver=ImportedOnCall("stacx.trainer.text_workload:TextDriver"),
    objective_base=Specialization,
    runtime=ImportedOnCall("stacx.trainer.text_workload:text_runtime"),
))
"""The core's own workload; its driver and runtime are named, not imported (`trainer.config` never imports the
trainer's loop or runtime)."""


__all__ = ["TEXT_MODALITY", "TEXT_WORKLOAD", "WORKLOADS", "Workload", "WorkloadDriver", "get_workload", "known_modalities",
           "register_workload", "unregister_workload"]
