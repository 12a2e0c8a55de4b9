"""The `Sandbox` interface every backend implements, and the result of one command.

    sandbox = build_sandbox(SandboxConfig(backend="namespace"))
    with sandbox.create("path/to/repo") as session:         # a fresh working copy of the folder
        result = session.run("python -m unittest", SandboxLimits(wall_time_s=10))
        result.exit_code, result.stdout, result.timed_out     # 0, '...', False
    # close(): every process the session started is dead and its working copy is deleted

A session's commands run in its working copy (`/workspace` inside the sandbox) and see each
other's file changes; each `run` starts a fresh process tree and kills what is left of it when the
command exits, so no process outlives its command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Protocol, Union, runtime_checkable

from stacx.sandbox.limits import SandboxLimits

WORKDIR = "/workspace"
"""Where the working copy is mounted inside a local sandbox (the current directory of every command)."""

Command = Union[str, list[str]]
"""A shell command line (run by `sh -c`) or an argument vector."""

Source = Union[str, os.PathLike, bytes]
"""A working copy's origin: a folder, a .tar / .tar.gz file, or the bytes of a tarball."""


class SandboxUnavailableError(RuntimeError):
    """The configured backend cannot run on this machine, or its server does not answer; the message
    names the setting and the fix."""

    infrastructure_cause = "sandbox"
    """Not the policy's doing: an episode that meets it is played again (stacx.rollout.episode_retry)."""


class SandboxServerError(RuntimeError):
    """The sandbox server failed a request (HTTP 5xx) or no longer knows the session (404: it restarted)."""

    infrastructure_cause = "sandbox"


class SandboxClosedError(RuntimeError):
    """`run` on a session after `close()`."""


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed command did."""

    exit_code: Optional[int]
    """The command's exit status; 128 + N when signal N ended it; None when the sandbox killed it."""
    stdout: str
    """Standard output (UTF-8, undecodable bytes replaced), at most `max_output_bytes` of it."""
    stderr: str
    """Standard error, the same way."""
    timed_out: bool = False
    """The wall-time limit expired and the process tree was killed."""
    killed: bool = False
    """The sandbox killed the process tree (wall time, or output past the cap)."""
    output_truncated: bool = False
    """stdout or stderr went past `max_output_bytes`; the command was killed there."""
    duration_s: float = 0.0
    """Wall time of the command, sandbox start-up included."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.killed

    def to_dict(self) -> dict:
        return {"exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr, "timed_out": self.timed_out,
                "killed": self.killed, "output_truncated": self.output_truncated, "duration_s": self.duration_s}


class ClosedOnExit:
    """What every session class shares: `with sandbox.session(source) as session:` closes it on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@runtime_checkable
class SandboxSession(Protocol):
    """One working copy and the commands run in it."""

    def run(self, command: Command, limits: Optional[SandboxLimits] = None, *,
            stdin: Optional[bytes] = None) -> RunResult:
        """Run `command` in the working copy under `limits` (the sandbox's defaults when None)."""
        ...

    def close(self) -> None:
        """Kill every process of the session and delete its working copy (idempotent)."""
        ...

    def __enter__(self) -> "SandboxSession": ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class Sandbox(Protocol):
    """A backend: makes sessions, each with a fresh working copy."""

    name: str

    def create(self, source: Source) -> SandboxSession:
        """A session whose working copy is a fresh copy of `source` (the source is never modified)."""
        ...
