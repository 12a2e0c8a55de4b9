"""Finding the workloads (`stacx.trainer.config.workload`) before a recipe is looked up.

Two sources, imported once by `discover_workloads()` (every command that resolves or lists recipes
calls it first):
1. `BUILTIN_WORKLOAD_MODULES`: Stacx's own workloads (the experimental diffusion recipes);
2. the `stacx.workloads` entry points of installed packages: a third-party package declares

       entry_points={"stacx.workloads": ["my_modality = my_package.stacx_workload"]}

   and the named module calls `register_workload(...)` and defines its `@recipe`s when imported.

A `stacx/custom/` or `--custom-module` file may register a workload too (it is imported before the
recipe is looked up). The core (`stacx.trainer`, `stacx.rollout`) never imports a workload's
package; this module, in the launch layer, is where they are named.
"""

from __future__ import annotations

import importlib
from importlib import metadata

BUILTIN_WORKLOAD_MODULES = ("stacx.diffusion.recipes",)
"""Modules whose import registers a built-in workload and its recipes."""

ENTRY_POINT_GROUP = "stacx.workloads"
"""The entry-point group of third-party workloads."""

_discovered = False


def workload_entry_points() -> list[metadata.EntryPoint]:
    """The installed packages' `stacx.workloads` entry points."""
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def discover_workloads() -> None:
    """Import the built-in workload modules and every `stacx.workloads` entry point, once (idempotent).
    An entry point that fails to import is an error naming it and its package."""
    global _discovered
    if _discovered:
        return
    for module in BUILTIN_WORKLOAD_MODULES:
        importlib.import_module(module)
    for entry in workload_entry_points():
        try:
            entry.load()
        except Exception as error:
            package = entry.dist.name if getattr(entry, "dist", None) is not None else "?"
            raise ImportError(f"{ENTRY_POINT_GROUP} entry point {entry.name!r} = {entry.value!r} (package {package}) "
                              f"failed to import: {type(error).__name__}: {error}") from error
    _discovered = True


__all__ = ["BUILTIN_WORKLOAD_MODULES", "ENTRY_POINT_GROUP", "discover_workloads", "workload_entry_points"]
