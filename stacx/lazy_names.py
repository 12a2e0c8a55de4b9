"""A package's public names imported on first use (PEP 562), so importing the package stays light.

    __getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())   # _PUBLIC: name -> defining module
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_names(package: str, public: dict[str, str], namespace: dict[str, Any]) -> tuple[Callable, Callable]:
    """The module-level `__getattr__` and `__dir__` of `package`: a name of `public` is imported from its
    module on first access and kept in `namespace` (the package's globals), so later look-ups skip it."""

    def __getattr__(name: str):
        if name in public:
            value = getattr(import_module(public[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(public))

    return __getattr__, __dir__
