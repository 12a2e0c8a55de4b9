"""What importing a module loads, checked in a process forked from the rank forkserver
(`stacx.testing.distributed.run_forked`): kept apart from the test modules, since unpickling the probe imports
its module. The forked process already holds what the forkserver preloaded (torch, megatron-core,
`stacx.parallel.groups`), so the modules it reports are a superset of what a fresh interpreter would load."""

import importlib
import sys


def stacx_modules_after_importing(name: str) -> list[str]:
    """The `stacx` modules loaded in this process once `name` is imported."""
    importlib.import_module(name)
    return [module for module in sys.modules if module.startswith("stacx")]
