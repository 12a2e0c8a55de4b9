"""Sandboxes for tool code: a fresh working copy per session, kernel limits, no network, tree kill.

`build_sandbox(SandboxConfig(...))` picks a backend by name (`namespace`, `bubblewrap`, `remote`);
docs/agents.md ("Sandbox") says what each one guarantees.
"""

from stacx.sandbox.config import SANDBOX_BACKENDS, SandboxConfig, build_sandbox
from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.protocol import (WORKDIR, RunResult, Sandbox, SandboxClosedError, SandboxSession,
                                    SandboxUnavailableError)

__all__ = ["SANDBOX_BACKENDS", "SandboxConfig", "build_sandbox", "SandboxLimits", "WORKDIR", "RunResult", "Sandbox",
           "SandboxClosedError", "SandboxSession", "SandboxUnavailableError"]
