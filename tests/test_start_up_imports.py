"""What a process a run starts imports before it does any work (start-up time, paid by every launch).

A Ray role worker imports `stacx.trainer.cluster.ray.role_worker` when its actor starts; what it
needs later (megatron-core through `stacx.parallel.megatron_import`, the model) it imports when the
driver's calls arrive. The modules below are each a second or more of CPU per process and are used
only elsewhere: the rollout stack and the run checks on the driver, `transformers` in the engine and
the tokenizer, `torch._dynamo` only when something compiles. Run in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NOT_AT_WORKER_START_UP = ("transformers", "torch._dynamo", "megatron.core", "stacx.trainer.config.checks",
                          "stacx.rollout.agents", "stacx.rollout.manager", "stacx.rollout.evaluation")
"""Packages a role worker must not load by importing its entry module (each with its submodules)."""


def modules_loaded_by_importing(module: str) -> list[str]:
    probe = f"import sys, {module}; print('\\n'.join(sys.modules))"
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


def test_a_ray_role_worker_starts_without_the_rollout_stack_transformers_or_the_compiler():
    loaded = modules_loaded_by_importing("stacx.trainer.cluster.ray.role_worker")
    assert "stacx.trainer.cluster.ray.role_worker" in loaded
    crept_in = sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in NOT_AT_WORKER_START_UP))
    assert not crept_in, (f"importing the role worker's entry module loads {crept_in}: import them where they are "
                          "used (a function-local import with a comment saying why)")
