"""megatron-core imported with its import-time `torch.compile` deferred (stacx.parallel.megatron_import).

Checked in a rank forked from the test forkserver, which imported megatron-core through
`import_megatron_core` (stacx.testing.megatron_preload), as role workers and servers do."""

from __future__ import annotations

import sys

import pytest
import torch

from stacx.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def megatron_as_imported_by_the_forkserver(_groups):
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_swiglu

    from stacx.parallel import megatron_import

    seen = {
        "compiler_imported_at_start": "torch._dynamo" in sys.modules,
        "torch_compile_restored": torch.compile is megatron_import._real_compile,
        "jit_fuser_defers": jit.jit_fuser is megatron_import.compile_on_first_call,
        "kernel_wraps_the_plain_function": fused_bias_swiglu.swiglu.uncompiled.__name__ == "swiglu",
    }
    compiled_calls = []

    def recording_compile(fn, **kwargs):  # stands in for the real compiler: records, compiles nothing
        compiled_calls.append((fn.__name__, kwargs))
        return fn

    megatron_import._real_compile = recording_compile
    y = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    first, second = fused_bias_swiglu.swiglu(y), fused_bias_swiglu.swiglu(y)
    gate, up = torch.chunk(y, 2, -1)
    seen["result_equals_eager"] = torch.equal(first, torch.nn.functional.silu(gate) * up) and torch.equal(first, second)
    seen["cpu_tensors_never_compile"] = compiled_calls == []
    # A tensor off the CPU (the meta device stands in for an accelerator here) compiles at its first call.
    on_device = torch.empty(3, 8, device="meta")
    fused_bias_swiglu.swiglu(on_device), fused_bias_swiglu.swiglu(on_device)
    seen["compiled_once_at_first_accelerator_call"] = compiled_calls == [("swiglu", {})]
    return seen


def test_megatron_is_imported_without_the_compiler_and_compiles_a_kernel_at_its_first_accelerator_call():
    [seen] = run_distributed(megatron_as_imported_by_the_forkserver, 1)
    assert seen == {"compiler_imported_at_start": False, "torch_compile_restored": True, "jit_fuser_defers": True,
                    "kernel_wraps_the_plain_function": True, "result_equals_eager": True,
                    "cpu_tensors_never_compile": True, "compiled_once_at_first_accelerator_call": True}


def test_keyword_form_passes_its_arguments_to_the_compiler(monkeypatch):
    from stacx.parallel import megatron_import

    calls = []
    monkeypatch.setattr(megatron_import, "_real_compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    doubled = megatron_import.compile_on_first_call(mode="max-autotune", dynamic=False)(lambda x: 2 * x)
    assert calls == []  # nothing is compiled when decorating
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0)) and calls == []  # CPU: eager
    on_device = torch.empty(2, device="meta")
    assert doubled(on_device).shape == (2,) and doubled(x=on_device).shape == (2,)
    assert calls == [{"mode": "max-autotune", "dynamic": False}]
