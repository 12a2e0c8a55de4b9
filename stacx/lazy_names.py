"""A package's public names imported on first use (PEP 562), so importing the package stays light.

    __all__, __getattr__, __dir__ = lazy_names(__name__, {"pkg.module": ("Name", "other_name")}, globals())
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_names(package: str, exports: dict[str, tuple[str, ...]], namespace: dict[str, Any]
               ) -> tuple[list[str], Callable, Callable]:
    """`__all__`, `__getattr__` and `__dir__` of `package`, whose public names are `exports` (module ->
    the names it defines, as in `from module import ...`). A name is imported from its module on first
    access and kept in `namespace` (the package's globals), so later look-ups skip `__getattr__`."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name in home:
            value = getattr(import_module(home[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(home))

    return sorted(home), __getattr__, __dir__
