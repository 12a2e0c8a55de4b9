"""Where an agent scaffold runs the policy's commands: one sandbox session per episode.

A scaffold that runs the model's shell commands itself (mini-swe-agent's `LocalEnvironment`, a
`subprocess.run(command, shell=True)` in your own loop) runs them on the trainer's host, as the trainer's
user, with the trainer's environment and files within reach: under RL the policy is searched for exactly
the command that reads a key or writes its own reward. `SandboxEnvironment` runs each of them through
`stacx.sandbox` instead: a fresh working copy of the task's repository, no network, the sandbox's fixed
environment, the limits of `SandboxLimits`, and `close()` (at the episode's end) kills what is left and
deletes the copy.

It is a mini-swe-agent environment as shipped scaffolds expect one (`execute(action, cwd, timeout=)` ->
`{"output", "returncode", "exception_info"}`, `get_template_vars`, `serialize`, `config`), so mini-swe-agent
uses it unmodified:

    env = SandboxEnvironment(source="path/to/repo", sandbox={"backend": "namespace"}, timeout=60)
    agent = DefaultAgent(model, env, **agent_config)     # minisweagent.agents.default
    try:
        agent.run(task)
        env.execute({"command": "git diff"})              # the episode's working copy, still open
    finally:
        env.close()

or from its command line: `mini --environment-class stacx.sandbox.agent_environment.SandboxEnvironment -c
environment.source=path/to/repo ...`. Any other scaffold follows the same pattern: open one session per
episode (`build_sandbox(SandboxConfig(...)).create(source)`), send every command the model chooses to
`session.run(command, limits)`, give the model `RunResult.stdout`/`stderr`/`exit_code`, close the session
when the episode ends.
"""

from __future__ import annotations

import io
import platform
import shlex
import tarfile
import weakref
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

from stacx.sandbox.config import SandboxConfig, build_sandbox
from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.protocol import Sandbox, SandboxSession

__all__ = ["SandboxEnvironment", "SandboxEnvironmentConfig", "SUBMIT_MARKER"]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's convention: a command whose output starts with this line (exit code 0) submits."""


@dataclass(frozen=True, kw_only=True)
class SandboxEnvironmentConfig:
    """The settings of a `SandboxEnvironment` (its keyword arguments; mini-swe-agent's `environment:` section)."""

    source: Optional[str] = None
    """The working copy's origin: a folder or a .tar/.tar.gz file, copied fresh for the episode (never modified);
    None: an empty working copy."""
    sandbox: dict = field(default_factory=dict)
    """The sandbox setting (a SandboxConfig mapping: backend, limits, read_only_paths, ...); empty: the defaults."""
    timeout: float = 60.0
    """Seconds a command may run (its wall-time limit) unless `execute` names another; then its whole process
    tree is killed."""
    cwd: str = ""
    """Folder commands start in, relative to the working copy's root (or absolute inside the sandbox); empty:
    the root (`/workspace`)."""
    submit_marker: Optional[str] = SUBMIT_MARKER
    """First output line that submits (mini-swe-agent's `Submitted`); None: never."""


def empty_tarball() -> bytes:
    """A tarball without members: the source of an empty working copy."""
    buffer = io.BytesIO()
    tarfile.open(fileobj=buffer, mode="w").close()
    return buffer.getvalue()


class SandboxEnvironment:
    """Every command of one episode in one sandbox session (module doc)."""

    def __init__(self, *, session: Optional[SandboxSession] = None, sandbox: Union[dict, SandboxConfig, Sandbox, None] = None,
                 **settings: Any):
        """session: an open session to run the commands in (the caller's working copy; `close()` closes it);
        else one is created from `source` with `sandbox` (a setting mapping, a SandboxConfig or a built Sandbox)."""
        known = {f.name for f in fields(SandboxEnvironmentConfig)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"SandboxEnvironment: unknown setting(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known | {'session'}))}")
        setting = sandbox if isinstance(sandbox, dict) else {}
        self.config = SandboxEnvironmentConfig(sandbox=dict(setting), **settings)
        if sandbox is None or isinstance(sandbox, dict):
            sandbox = SandboxConfig.from_dict(self.config.sandbox)
        if isinstance(sandbox, SandboxConfig):
            self.limits = sandbox.limits
            sandbox = build_sandbox(sandbox) if session is None else None
        else:
            self.limits = getattr(sandbox, "default_limits", SandboxLimits())
        if session is None:
            session = sandbox.create(self.config.source if self.config.source is not None else empty_tarball())
        self.session = session
        # A session must not outlive its environment even if the scaffold never calls close().
        self._closer = weakref.finalize(self, session.close)

    def execute(self, action: Union[dict, str], cwd: str = "", *, timeout: Optional[float] = None) -> dict[str, Any]:
        """Run one command (`action["command"]`, or a string) in the session; stdout and stderr interleaved,
        as mini-swe-agent's local environment gives them. A command killed at its time limit, or a sandbox
        that failed, answers returncode -1 with `exception_info` saying why; the scaffold goes on."""
        command = action.get("command", "") if isinstance(action, dict) else str(action)
        folder = cwd or self.config.cwd
        script = "exec 2>&1\n" + (f"cd -- {shlex.quote(folder)} || exit 1\n" if folder else "") + command
        wall_time_s = float(timeout or self.config.timeout)
        try:
            result = self.session.run(["sh", "-c", script], replace(self.limits, wall_time_s=wall_time_s))
        except Exception as error:  # noqa: BLE001 - a failed sandbox is the model's observation, not a crash
            return {"output": "", "returncode": -1,
                    "exception_info": f"the sandbox failed: {type(error).__name__}: {error}"}
        output = {"output": result.stdout + result.stderr, "returncode": -1 if result.exit_code is None
                  else result.exit_code, "exception_info": ""}
        if result.timed_out:
            output["exception_info"] = f"the command timed out after {wall_time_s:g} s and was killed"
        elif result.output_truncated:
            output["exception_info"] = "the command wrote more output than the sandbox keeps and was killed"
        self._check_submitted(output)
        return output

    def _check_submitted(self, output: dict) -> None:
        """mini-swe-agent's submit convention: raise its `Submitted` with the rest of the output."""
        marker = self.config.submit_marker
        lines = output["output"].lstrip().splitlines(keepends=True)
        if not marker or not lines or lines[0].strip() != marker or output["returncode"] != 0:
            return
        from minisweagent.exceptions import Submitted  # only a mini-swe-agent scaffold prints its marker

        submission = "".join(lines[1:])
        raise Submitted({"role": "exit", "content": submission,
                         "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The settings and the kernel's description (`system`, `release`, `version`, `machine`, which
        mini-swe-agent's prompts name); never the host's environment variables."""
        uname = platform.uname()
        values = {f.name: getattr(self.config, f.name) for f in fields(self.config)}
        values.update(system=uname.system, release=uname.release, version=uname.version, machine=uname.machine)
        return {**values, **kwargs}

    def serialize(self) -> dict:
        settings = {f.name: getattr(self.config, f.name) for f in fields(self.config)}
        return {"info": {"config": {"environment": settings,
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def close(self) -> None:
        """Kill whatever still runs in the session and delete its working copy (idempotent)."""
        self._closer()

    def __enter__(self) -> "SandboxEnvironment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
