"""Quiet the warnings megatron-core prints in every process about fallbacks Stacx expects.

On a machine without Apex and Transformer Engine (every CPU run), each process that imports
megatron-core prints about eight UserWarnings ("Apex is not installed. Falling back to Torch
Norm", "Transformer Engine and Apex are not installed. Falling back to ..."), and building a
model adds megatron's warning about its own default `cuda_graph_scope`. Stacx runs, and tests,
exactly those fallbacks on CPU (stacx.parallel.megatron_cpu_compat), so the warnings only bury
the run's own output. `silence_expected_backend_warnings()` ignores these messages, and only
when they come from megatron modules; `STACX_SHOW_BACKEND_WARNINGS=1` keeps them.

`stacx/__init__.py` calls it, so every process that imports Stacx (the driver, Ray workers,
`stacx serve`) installs the filters before megatron-core is first imported.
"""

from __future__ import annotations

import os
import warnings

SHOW_ENV = "STACX_SHOW_BACKEND_WARNINGS"
"""Set to 1 to see megatron-core's fallback warnings."""

EXPECTED_BACKEND_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)
"""Message prefixes (regular expressions) of megatron-core warnings about expected fallbacks."""


def silence_expected_backend_warnings(environ=os.environ) -> bool:
    """Install 'ignore' filters for EXPECTED_BACKEND_WARNINGS from megatron modules, unless
    STACX_SHOW_BACKEND_WARNINGS=1; returns whether it installed them."""
    if environ.get(SHOW_ENV, "") == "1":
        return False
    for message in EXPECTED_BACKEND_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
    return True
