"""Importing the modules whose decorators fill the registries.

Three sources, all imported before the first registry lookup:
1. every module inside `stacx/objectives/` (the built-ins), found by walking the package;
2. every module inside the `stacx/custom/` folder (drop a file there, nothing else to do);
3. user modules named on the command line or in the config (`--custom-module my_algo.py`,
   repeatable; a file path or an importable dotted module name), via `load_custom_modules`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pkgutil
import sys
from types import ModuleType
from typing import Iterable

_AUTO_IMPORT_PACKAGES = ("stacx.objectives", "stacx.custom")
_auto_import_done = False


def _import_package_tree(package_name: str) -> list[str]:
    package = importlib.import_module(package_name)
    imported = []
    for info in pkgutil.walk_packages(package.__path__, prefix=package_name + "."):
        try:
            importlib.import_module(info.name)
        except Exception as error:
            raise ImportError(f"importing objectives module {info.name!r} failed: {error}") from error
        imported.append(info.name)
    return imported


def import_builtin_and_custom_modules() -> None:
    """Import every module of `stacx.objectives` and `stacx.custom` once (idempotent)."""
    global _auto_import_done
    if _auto_import_done:
        return
    # Set first: modules being imported may themselves trigger a lookup.
    _auto_import_done = True
    try:
        for package_name in _AUTO_IMPORT_PACKAGES:
            _import_package_tree(package_name)
    except BaseException:
        _auto_import_done = False
        raise


def _module_name_for_file(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    safe_stem = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
    return f"stacx_user_module_{safe_stem}_{digest}"


def _load_file(path: str, flag: str) -> ModuleType:
    resolved = os.path.realpath(path)
    if not os.path.isfile(resolved):
        raise ValueError(f"{flag} {path!r}: no such file")
    module_name = _module_name_for_file(resolved)
    if module_name in sys.modules:  # loading the same file twice must not re-register names
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag} {path!r}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ValueError(f"{flag} {path!r}: importing the file failed: {type(error).__name__}: {error}") from error
    return module


def load_custom_modules(paths_or_module_names: Iterable[str] | str, *, flag: str = "--custom-module") -> list[ModuleType]:
    """Import user modules so their `@register_*` decorators run; returns the modules.

    Each entry is a path to a `.py` file (anything ending in `.py` or containing a path
    separator) or a dotted module name importable from `sys.path`. Loading the same file again
    is a no-op. Errors are `ValueError`s naming `flag` and the offending entry.
    """
    if isinstance(paths_or_module_names, str):
        paths_or_module_names = [paths_or_module_names]
    import_builtin_and_custom_modules()
    modules = []
    for entry in paths_or_module_names:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{flag}: expected a file path or module name, got {entry!r}")
        if entry.endswith(".py") or os.sep in entry or "/" in entry:
            modules.append(_load_file(entry, flag))
            continue
        try:
            modules.append(importlib.import_module(entry))
        except Exception as error:
            raise ValueError(f"{flag} {entry!r}: importing the module failed: {type(error).__name__}: {error}") from error
    return modules
