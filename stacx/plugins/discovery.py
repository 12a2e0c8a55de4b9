"""Importing the modules whose decorators fill the registries.

Three sources, all imported before the first registry lookup (`import stacx.objectives` imports
only the first; see `import_builtin_modules` for why):
1. every module inside `stacx/objectives/` (the built-ins), found by walking the package;
2. every module inside the `stacx/custom/` folder (drop a file there, nothing else to do);
3. user modules named on the command line or in the config (`--custom-module my_algo.py`,
   repeatable; a file path or an importable dotted module name), via `load_custom_modules`.

User code must reach every process that builds a role runtime, including Ray workers on other
nodes whose file system may not hold the file. So every user module imported here (sources 2
and 3) is recorded with its *source text* (`user_module_sources()`), in import order; the driver
ships those records to each Ray worker at creation, and the worker makes them importable by name
(`ShippedSourceFinder`, so one user module may import another: a recipe file importing its
specialization file) and imports them (`import_user_module_sources`) before any call arrives, so
a custom kernel, recipe or specialization class pickled by reference resolves there. A user file that raises while it is
auto-imported from `stacx/custom/` never breaks `import stacx`: it is skipped with a warning
naming the file (a `--custom-module` file that raises is an error naming the flag).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.abc
import importlib.util
import os
import pkgutil
import sys
import traceback
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable

BUILTIN_PACKAGE = "stacx.objectives"
USER_PACKAGE = "stacx.custom"
_auto_import_done = False


@dataclass(frozen=True)
class UserModuleSource:
    """One imported user module, as shipped to other processes: its name, source text and origin."""

    module_name: str
    """The name it has in `sys.modules` (`stacx.custom.my_algo`, `stacx_user_module_my_algo_<hash>`)."""
    source: str
    """The file's text, executed as that module in the receiving process."""
    origin: str
    """The file it was read from on the sending machine (error messages and tracebacks only)."""
    is_package: bool = False
    """True for a package's `__init__.py` (the receiver sets an empty `__path__`)."""


_USER_MODULE_SOURCES: dict[str, UserModuleSource] = {}
"""module name -> source of every user module imported in this process, in import order."""


def _record_source(module: ModuleType) -> None:
    origin = getattr(module, "__file__", None)
    if module.__name__ in _USER_MODULE_SOURCES or not origin or not origin.endswith(".py"):
        return
    try:
        with open(origin, encoding="utf-8") as handle:
            source = handle.read()
    except OSError:
        return
    is_package = os.path.basename(origin) == "__init__.py"
    _USER_MODULE_SOURCES[module.__name__] = UserModuleSource(module.__name__, source, origin, is_package)


def record_user_module(module_name: str | None) -> None:
    """Ship `module_name` to workers too: a user module that registered a kernel or recipe after a
    plain `import my_algorithm` (guide 001's "import to register"), not through
    `--custom-module`. Only a top-level module (`my_algorithm`) or a `stacx/custom/` one is shipped
    this way: `__main__` is not (re-running a script in a worker is not an import), nor a module
    inside a package (load a package's modules with `--custom-module pkg.module`)."""
    if not module_name or module_name == "__main__":
        return
    if "." in module_name and not module_name.startswith(USER_PACKAGE + "."):
        return
    module = sys.modules.get(module_name)
    if module is not None:
        _record_source(module)


def user_module_sources() -> tuple[UserModuleSource, ...]:
    """Every user module this process imported (`stacx/custom/`, `--custom-module`), in import order."""
    return tuple(_USER_MODULE_SOURCES.values())


class ShippedSourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports shipped user modules by name, from their source text, whenever they are imported.

    Installed (last on `sys.meta_path`, so a file on this machine's disk wins) by
    `import_user_module_sources`. A user module that imports another one (a recipe file doing
    `from stacx.custom.my_algo_spec import MySpec`) then finds it here, whatever the order the
    two are executed in: the shipped folder behaves as a package."""

    def __init__(self):
        self.sources: dict[str, UserModuleSource] = {}

    def find_spec(self, fullname, path=None, target=None):
        entry = self.sources.get(fullname)
        if entry is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=entry.origin, is_package=entry.is_package)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        entry = self.sources[module.__name__]
        module.__file__ = entry.origin
        if entry.is_package:
            module.__path__ = []  # its submodules come from this finder
        exec(compile(entry.source, entry.origin, "exec"), module.__dict__)  # noqa: S102 - the user's own module


_SHIPPED_SOURCES = ShippedSourceFinder()


def import_user_module_sources(sources) -> list[str]:
    """Import shipped user modules under their own names (in a worker, before any call arrives).

    Every source is made importable first (`ShippedSourceFinder`), then each is imported in the
    order given (the driver's import order). A module already in `sys.modules` (the worker
    imported the same `stacx/custom/` file from its own disk) is kept as is, so no name is
    registered twice. Returns the names imported here. Raises `ImportError` naming the module,
    the file it came from and the error, with the user file's own traceback, when one fails.
    """
    import_builtin_and_custom_modules()
    sources = tuple(sources)
    for entry in sources:
        _SHIPPED_SOURCES.sources.setdefault(entry.module_name, entry)
    if _SHIPPED_SOURCES not in sys.meta_path:
        sys.meta_path.append(_SHIPPED_SOURCES)
    already_imported = {entry.module_name for entry in sources if entry.module_name in sys.modules}
    for entry in sources:
        if entry.module_name in sys.modules:
            continue
        try:
            importlib.import_module(entry.module_name)
        except Exception as error:
            sys.modules.pop(entry.module_name, None)
            trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            raise ImportError(
                f"custom module {entry.module_name!r} (from {entry.origin}) failed to import in this process, "
                f"which executes the source the driver shipped: {type(error).__name__}: {error}\n{trace}"
            ) from error
    executed = [entry.module_name for entry in sources if entry.module_name not in already_imported]
    for entry in sources:
        if entry.module_name in executed:
            _USER_MODULE_SOURCES.setdefault(entry.module_name, entry)
    return executed


def _import_package_tree(package_name: str) -> list[str]:
    """Import every module under `package_name` (recursively); the first failure raises, naming it."""
    package = importlib.import_module(package_name)
    imported = []
    for info in pkgutil.walk_packages(package.__path__, prefix=package_name + "."):
        try:
            importlib.import_module(info.name)
        except Exception as error:
            raise ImportError(f"importing objectives module {info.name!r} failed: {error}") from error
        imported.append(info.name)
    return imported


def _import_user_package() -> None:
    """Import every module of `stacx/custom/`; one that raises is skipped with a warning naming its file."""
    package = importlib.import_module(USER_PACKAGE)
    for info in pkgutil.walk_packages(package.__path__, prefix=USER_PACKAGE + ".",
                                      onerror=lambda name: warnings.warn(f"stacx/custom: package {name!r} failed to import")):
        recorded_before = set(_USER_MODULE_SOURCES)
        try:
            module = importlib.import_module(info.name)
        except Exception as error:  # noqa: BLE001 - a user file must never break `import stacx`
            path = os.path.join(getattr(info.module_finder, "path", "?"), info.name.rpartition(".")[2])
            warnings.warn(
                f"stacx/custom: skipped {path}{'' if info.ispkg else '.py'} ({info.name}), which raised "
                f"{type(error).__name__}: {error}; its registrations are not available. Fix the file or move it out "
                "of stacx/custom/.",
                RuntimeWarning, stacklevel=2,
            )
            sys.modules.pop(info.name, None)
            continue
        # In import order: a `stacx/custom/` module this one imported (a recipe file importing its
        # specialization file) is recorded before it, so workers import the two in the same order.
        for name in [n for n in list(sys.modules) if n.startswith(USER_PACKAGE + ".") and n != info.name]:
            if name not in recorded_before and sys.modules[name] is not None:
                _record_source(sys.modules[name])
        _record_source(module)


_builtins_done = False


def import_builtin_modules() -> None:
    """Import every module of `stacx.objectives` once (idempotent); `import stacx.objectives` does this.

    `stacx/custom/` is not imported here: a user file there may import `stacx.trainer.recipes`,
    which imports this package, so importing user files from this package's `__init__` would be
    an import cycle. They are imported at the first registry lookup instead.
    """
    global _builtins_done
    if _builtins_done:
        return
    _builtins_done = True
    try:
        _import_package_tree(BUILTIN_PACKAGE)
    except BaseException:
        _builtins_done = False
        raise


def import_builtin_and_custom_modules() -> None:
    """Import every module of `stacx.objectives` and `stacx.custom` once (idempotent).

    Called by every registry lookup and listing, and by the trainer before it picks a recipe.
    """
    global _auto_import_done
    if _auto_import_done:
        return
    # Set first: modules being imported may themselves trigger a lookup.
    _auto_import_done = True
    try:
        import_builtin_modules()
        _import_user_package()
    except BaseException:
        _auto_import_done = False
        raise


def _module_name_for_file(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    safe_stem = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
    return f"stacx_user_module_{safe_stem}_{digest}"


def _load_file(path: str, flag: str, ship_to_workers: bool = True) -> ModuleType:
    resolved = os.path.realpath(path)
    if not os.path.isfile(resolved):
        raise ValueError(f"{flag} {path!r}: no such file")
    module_name = _module_name_for_file(resolved)
    if module_name in sys.modules:  # loading the same file twice must not re-register names
        if ship_to_workers:
            _record_source(sys.modules[module_name])  # but it is shipped to workers (again) all the same
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
        # A registration inside the failed file may already have recorded it for shipping; a file
        # that did not import must never be shipped to (and re-raise in) every worker.
        _USER_MODULE_SOURCES.pop(module_name, None)
        raise ValueError(f"{flag} {path!r}: importing the file failed: {type(error).__name__}: {error}") from error
    if ship_to_workers:
        _record_source(module)
    return module


def is_file_path(entry: str) -> bool:
    """Whether a `--custom-module` (or `--reward-fn`) entry names a file rather than a dotted module."""
    return entry.endswith(".py") or os.sep in entry or "/" in entry


def resolve_callable(spec: str, *, flag: str, ship_to_workers: bool = False) -> Callable:
    """The function a 'package.module:function' or 'path/to/file.py:function' spec names (a file is
    loaded as `--custom-module` loads files). Errors are `ValueError`s naming `flag`, with the closest
    name when the function is misspelled."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        file_hint = f" (give the function too: {spec}:my_function)" if is_file_path(spec) else ""
        raise ValueError(f"{flag} {spec!r} is not 'module:function' or 'path/to/file.py:function'{file_hint}")
    if is_file_path(module_name):
        module = load_custom_modules([module_name], flag=flag, ship_to_workers=ship_to_workers)[0]
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{flag} {spec!r}: cannot import module {module_name!r}: {err} (a file is given "
                             "as path/to/file.py:function)") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        close = difflib.get_close_matches(attr, [n for n in dir(module) if callable(getattr(module, n))], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{flag} {spec!r}: {module_name!r} has no callable {attr!r}{hint}")
    return fn


def load_custom_modules(paths_or_module_names: Iterable[str] | str, *, flag: str = "--custom-module",
                        ship_to_workers: bool = True) -> list[ModuleType]:
    """Import user modules so their `@register_*` decorators run; returns the modules.

    Each entry is a path to a `.py` file (anything ending in `.py` or containing a path
    separator) or a dotted module name importable from `sys.path`. Loading the same file again
    is a no-op. Errors are `ValueError`s naming `flag` and the offending entry.
    `ship_to_workers=False`: code only the driver runs (a `--reward-fn` file) is not sent to the
    role workers (a kernel or recipe it registers still is).
    """
    if isinstance(paths_or_module_names, str):
        paths_or_module_names = [paths_or_module_names]
    import_builtin_and_custom_modules()
    modules = []
    for entry in paths_or_module_names:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{flag}: expected a file path or module name, got {entry!r}")
        if is_file_path(entry):
            modules.append(_load_file(entry, flag, ship_to_workers))
            continue
        try:
            module = importlib.import_module(entry)
        except Exception as error:
            _USER_MODULE_SOURCES.pop(entry, None)
            raise ValueError(f"{flag} {entry!r}: importing the module failed: {type(error).__name__}: {error}") from error
        if ship_to_workers:
            _record_source(module)
        modules.append(module)
    return modules
