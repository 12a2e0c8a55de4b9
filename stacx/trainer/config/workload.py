"""The workload registry: what runs a recipe of each `TrainingConfig.modality`.

A recipe says what its policy generates (`modality`). The core runs the `"text"` modality itself
(`StacxTrainer` over `RoleRuntime`s); every other modality is a registered `Workload`:

    register_workload(Workload(modality="image", description="...", driver=DiffusionDriver,
                               objective_base=DiffusionObjective, runtime=DiffusionRuntime))

`stacx train` asks `get_workload(recipe.modality)` for the driver of a non-text recipe; a recipe
naming a modality nobody registered fails at `@recipe` time, listing the registered ones. A package
registers its workload the way plugins are found: `stacx.launch.workloads` imports the built-in
ones and the `stacx.workloads` entry points of installed packages; a `stacx/custom/` or
`--custom-module` file may call `register_workload` itself. The core never imports a workload's
package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

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
    """The `TrainingConfig.modality` this workload runs (an identifier, not 'text')."""
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
        if self.modality == TEXT_MODALITY:
            raise ValueError(f"Workload.modality {TEXT_MODALITY!r} is the core's own (StacxTrainer); "
                             "register a workload under another modality name")
        if not isinstance(self.objective_base, type):
            raise ValueError(f"workload {self.modality!r}: field 'objective_base' must be a class, "
                             f"got {self.objective_base!r}")
        for name in ("driver", "runtime"):
            if not callable(getattr(self, name)):
                raise ValueError(f"workload {self.modality!r}: field {name!r} must be callable, "
                                 f"got {getattr(self, name)!r}")


WORKLOADS: dict[str, Workload] = {}
"""modality -> its registered Workload."""


def register_workload(workload: Workload) -> Workload:
    """Register `workload` under its modality. Registering the same object again is a no-op (a module
    imported twice); another workload under a taken modality is refused, naming both."""
    if not isinstance(workload, Workload):
        raise TypeError(f"register_workload expects a Workload, got {type(workload).__name__}")
    known = WORKLOADS.get(workload.modality)
    if known is not None and known != workload:
        raise ValueError(f"modality {workload.modality!r} already has a workload ({known.description!r}); "
                         "pick another modality name for yours")
    WORKLOADS[workload.modality] = workload
    return workload


def unregister_workload(modality: str) -> None:
    """Remove a registered workload (tests that register a toy one clean up with this)."""
    WORKLOADS.pop(modality, None)


def known_modalities() -> tuple[str, ...]:
    """'text' and every registered workload's modality."""
    return (TEXT_MODALITY, *sorted(WORKLOADS))


def get_workload(modality: str) -> Workload:
    """The workload registered for `modality`; ValueError listing the registered ones otherwise."""
    try:
        return WORKLOADS[modality]
    except KeyError:
        raise ValueError(f"no workload runs modality {modality!r}; registered: {', '.join(sorted(WORKLOADS)) or 'none'} "
                         f"({TEXT_MODALITY!r} is the core's own). Install or load the package that registers it "
                         "(a `stacx.workloads` entry point, stacx/custom/, or --custom-module)") from None


__all__ = ["TEXT_MODALITY", "WORKLOADS", "Workload", "WorkloadDriver", "get_workload", "known_modalities",
           "register_workload", "unregister_workload"]
