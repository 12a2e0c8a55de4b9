"""megatron-core, imported with its import-time `torch.compile` decorations deferred to their first call.

    from stacx.parallel.megatron_import import import_megatron_core
    import_megatron_core()            # before the process's first `from megatron.core import ...`

megatron-core decorates its fused element-wise kernels (bias + activation, bias + dropout + add,
cross-entropy pieces; about 40 functions in 16 modules) with `megatron.core.jit.jit_fuser`, which is
`torch.compile` on torch >= 2.2. `torch.compile(fn)` compiles nothing until `fn` is called, but it
imports `torch._dynamo` and inductor's front end at decoration time: 1.5-2.5 s of CPU in every
process that imports megatron-core (each Ray role worker, each rollout server, each torchrun rank),
for kernels that Stacx's CPU models never call (their fusions are off on CPU: models/builder.py).

`import_megatron_core` imports megatron-core while `torch.compile` is replaced by
`compile_on_first_call`, which wraps each decorated function so that the real `torch.compile` runs
when the function is first called, with the same arguments. What runs is unchanged (a GPU run that
calls a fused kernel compiles it at its first call, as before); only the import of the compiler
moves to that call. `torch.compile` itself is restored before the function returns, so no other
code sees the stand-in. A process that imports megatron-core some other way first pays the old
import time and nothing else changes.

On CPU tensors a deferred kernel runs eagerly and is never compiled. Some of these kernels do run on
CPU: the MoE router's top-k routing (`TopKRouter.routing`) is decorated, so every CPU MoE run compiled it
with inductor at its first step, which generates and builds C++ (it needs a compiler) for a handful of
element-wise operations on a few kilobytes: about 4 s of CPU per rank and process (measured with a
sampling profiler on a two-rank EP=2 GRPO launch: a third of each rank's samples), for no speed-up at
that size. A call with a tensor on an accelerator compiles as before.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch

_lock = threading.Lock()


def compile_on_first_call(model=None, **compile_kwargs):
    """`torch.compile`'s signature; returns `model` wrapped so that the real `torch.compile(model,
    **compile_kwargs)` is built at the first call and used for every call from then on."""
    if model is None:  # used as @torch.compile(...) with keyword arguments
        return lambda fn: compile_on_first_call(fn, **compile_kwargs)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if not _on_an_accelerator(args, kwargs):
            return model(*args, **kwargs)  # CPU tensors run eagerly: see the module docstring
        if compiled is None:
            compiled = _real_compile(model, **compile_kwargs)
        return compiled(*args, **kwargs)

    call.uncompiled = model
    return call


def _on_an_accelerator(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor argument lives off the CPU (a CUDA or other accelerator device)."""
    return any(isinstance(value, torch.Tensor) and value.device.type != "cpu"
               for value in (*args, *kwargs.values()))


_real_compile = torch.compile


def import_megatron_core() -> None:
    """Import megatron-core (once per process) with its import-time compilation deferred; see the module docstring."""
    if "megatron.core" in sys.modules:
        return
    with _lock:
        if "megatron.core" in sys.modules:
            return
        torch.compile = compile_on_first_call
        try:
            # Imported here: this function exists to control how megatron-core is first imported.
            import megatron.core  # noqa: F401
            import megatron.core.jit  # noqa: F401  (binds `jit_fuser` to the stand-in)
        finally:
            torch.compile = _real_compile
