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

In their place, `stacx train`, `stacx eval` and `stacx serve` print one line at start-up on a
machine without CUDA (`cpu_path_notice`) naming the optional GPU packages that are absent:

    stacx: CPU path; optional GPU packages not installed: transformer-engine, apex, sglang (expected on CPU; ...)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Callable, Optional

SHOW_ENV = "STACX_SHOW_BACKEND_WARNINGS"
"""Set to 1 to see megatron-core's fallback warnings."""

EXPECTED_BACKEND_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)
"""Message prefixes (regular expressions) of megatron-core warnings about expected fallbacks."""

EXPECTED_LIBRARY_NOTICES = (
    # megatron-core's torch_dist loader calls torch's deprecated `load_state_dict` (every resume).
    (FutureWarning, r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing"),
    # torch's checkpoint planner on megatron-core's ShardedTensors (every save and load).
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", r"torch\.distributed\.checkpoint"),
    # torch's rename of the collectives megatron-core's MoE all-gather dispatcher calls (expert parallelism).
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     r"torch\.distributed"),
    # megatron-core's advice for CUDA stream overlap with TP > 1 (docs/env-reference.md has it).
    (UserWarning, r"When using (sequence parallelism|async grad allreduce) it is recommended to set the "
                  r"environment variable CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\."),
)
"""(category, message, module) of deprecation notices and tuning advice inside the libraries, which
a user can do nothing about in their own code: hidden with the fallback warnings."""


def silence_expected_backend_warnings(environ=os.environ) -> bool:
    """Install 'ignore' filters for EXPECTED_BACKEND_WARNINGS from megatron modules, unless
    STACX_SHOW_BACKEND_WARNINGS=1; returns whether it installed them."""
    if environ.get(SHOW_ENV, "") == "1":
        return False
    for message in EXPECTED_BACKEND_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
    for category, message, module in EXPECTED_LIBRARY_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    return True


OPTIONAL_GPU_PACKAGES = (("transformer-engine", "transformer_engine"), ("apex", "apex"), ("sglang", "sglang"))
"""(distribution name shown, import name) of the GPU packages Stacx uses when present."""


def absent_gpu_packages(find_spec: Callable[[str], object] = importlib.util.find_spec) -> list[str]:
    """Names of the OPTIONAL_GPU_PACKAGES that are not importable (found without importing them)."""
    absent = []
    for shown, module in OPTIONAL_GPU_PACKAGES:
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-installed package counts as absent
            found = False
        if not found:
            absent.append(shown)
    return absent


def cpu_path_notice(cuda_available: bool, environ=os.environ,
                    find_spec: Callable[[str], object] = importlib.util.find_spec) -> Optional[str]:
    """The start-up line of a run on the CPU path, or None (CUDA present, or nothing absent)."""
    if cuda_available:
        return None
    absent = absent_gpu_packages(find_spec)
    if not absent:
        return None
    hidden = ("" if environ.get(SHOW_ENV, "") == "1" else
              f"; megatron's fallback warnings are hidden, {SHOW_ENV}=1 shows them")
    return (f"stacx: CPU path; optional GPU packages not installed: {', '.join(absent)} "
            f"(expected without a GPU: Stacx uses torch attention and the CPU engine{hidden})")


def print_cpu_path_notice(file=None) -> None:
    """Print `cpu_path_notice` to stderr (the first rank only under torchrun, where every rank starts)."""
    if os.environ.get("RANK", "0") != "0":
        return
    import torch

    notice = cpu_path_notice(torch.cuda.is_available())
    if notice:
        print(notice, file=file or sys.stderr, flush=True)
