"""Import a test dependency when a test first uses it, not when pytest collects the file.

Every pytest worker collects every test file, so a module-level `import anthropic` (about 4 s of CPU) or
`import openai` (about 1.7 s) is paid by each worker, also by those that run none of the file's tests
(docs/testing.md, session 12). `deferred_import` checks at collection that the package is installed
(a missing one fails with the fix, never a skip) and imports it on the first read of a public name.

    openai = deferred_import("openai", "the endpoint is driven by the official openai client")
    client = openai.OpenAI(...)  # imports openai here
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


class DeferredModule:
    """Stands for a module until one of its public names is read. Names that start with `_` are refused
    without importing: pytest reads such names (`__test__`, fixture markers) on every object of a test
    module while it collects, which would import the module there."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred_import(name: str, why: str) -> DeferredModule:
    """`name` imported on the first read of a public name; ImportError naming the test extra at once if it is
    not installed."""
    if importlib.util.find_spec(name) is None:
        raise ImportError(f"{why}, in the test extra: pip install -e '.[test]' (no module named {name!r})")
    return DeferredModule(name)
