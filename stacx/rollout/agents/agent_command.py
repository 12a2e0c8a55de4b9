"""A program as the agent (`--agent-command`): what it is given, what it may report, how long it may run.

    command = AgentCommand(argv=("my-agent", "--base-url", "{base_url}"), timeout_s=600, passed_env=("HF_HOME",))
    reward = command(base_url, task)          # None: the program wrote no reward; --reward-fn scores the episode

The program runs once per episode in its own process group, with

- a scrubbed environment (`agent_environment`): PATH, HOME, the locale variables, OPENAI_BASE_URL,
  OPENAI_API_KEY (the episode's own key, never the trainer's), the same for Anthropic clients
  (ANTHROPIC_BASE_URL: the base URL without `/v1`; ANTHROPIC_API_KEY), STACX_TASK (the task as JSON),
  STACX_REWARD_FILE, and the trainer's variables the user names (`--agent-env NAME`): nothing else of the
  trainer's environment (its tokens, its keys) reaches the program or the commands it runs;
- `{base_url}` and `{task_json}` in its arguments replaced (`substitute_placeholders`): as they are in an
  ordinary argument (one argv item, which no shell reads), shell-quoted inside the script of a shell
  (`sh -c '... {task_json} ...'`), so a dataset row cannot run `$(...)`;
- a reward channel the model's text cannot reach: the program writes the episode's reward (a JSON
  number, or an object with a "reward" number) to the file STACX_REWARD_FILE names, in a private folder
  (mode 0700) made for the episode. Standard output is never read as a reward: a policy whose answer ends
  with `{"reward": 1.0}`, echoed by its agent, earns nothing from it. The channel is private only when the
  policy's commands run in a sandbox (stacx.sandbox.agent_environment), not on the host as the trainer;
- a time limit (`--agent-timeout`): past it the program and every process of its group are killed and
  the episode fails (reward 0, its turns kept).

Its output goes to files in that private folder; what it printed is read with undecodable bytes replaced,
only to name the failure when it exits non-zero.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional

from stacx.rollout.episode_retry import AGENT_INFRASTRUCTURE_EXIT_CODE, InfrastructureError

__all__ = ["AgentCommand", "AgentCommandTimeout", "agent_environment", "read_reward_file", "substitute_placeholders",
           "PASSED_THROUGH", "DEFAULT_AGENT_TIMEOUT_S", "EPISODE_API_KEY"]

DEFAULT_AGENT_TIMEOUT_S = 3600.0
"""Seconds an agent program may run per episode unless --agent-timeout says otherwise."""

EPISODE_API_KEY = "stacx-episode"
"""OPENAI_API_KEY of an episode whose session needs no key of its own (clients require one; the server reads none)."""

PASSED_THROUGH = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ")
"""Trainer variables every agent program gets (when set), besides the locale's LC_* ones."""

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"})
"""Programs whose `-c` argument is a shell script: placeholders in it are replaced by shell-quoted values."""

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

STDERR_SHOWN_CHARS = 500
"""Characters of a failed program's standard error named in the episode's error."""


class AgentCommandTimeout(RuntimeError):
    """The agent program ran past --agent-timeout; it and its process group were killed."""


def agent_environment(base_url: str, task_json: str, reward_file: str, *, api_key: Optional[str] = None,
                      passed_env: tuple[str, ...] = (), environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The whole environment of one episode's program (module doc): nothing of `environ` (default: the
    trainer's) but PATH, HOME, the locale and the names in `passed_env`."""
    environ = os.environ if environ is None else environ
    env = {name: environ[name] for name in environ
           if name in PASSED_THROUGH or name.startswith("LC_") or name in passed_env}
    env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key or EPISODE_API_KEY,
               ANTHROPIC_BASE_URL=base_url.removesuffix("/v1"),  # Anthropic clients add /v1/messages
               ANTHROPIC_API_KEY=api_key or EPISODE_API_KEY, STACX_TASK=task_json, STACX_REWARD_FILE=reward_file)
    return env


def _shell_script_index(argv: list[str]) -> Optional[int]:
    """The index of the script in `sh [options] -c SCRIPT ...` (also `-ec`, `-lc`), else None."""
    if not argv or os.path.basename(argv[0]) not in SHELLS:
        return None
    for index, part in enumerate(argv[1:], start=1):
        if part == "--" or not part.startswith("-") or part.startswith("--"):
            return None
        if "c" in part[1:]:
            return index + 1 if index + 1 < len(argv) else None
    return None


def substitute_placeholders(argv: tuple[str, ...], values: Mapping[str, str]) -> list[str]:
    """`argv` with each `{name}` of `values` replaced: shell-quoted (shlex.quote) inside a shell's `-c`
    script, where a shell parses it; as it is in every other argument, which reaches the program as one
    argv item that no shell reads. Replaced literally, not by str.format: an inline script's own braces stay."""
    script = _shell_script_index(list(argv))
    substituted = []
    for index, part in enumerate(argv):
        for name, value in values.items():
            part = part.replace("{" + name + "}", shlex.quote(value) if index == script else value)
        substituted.append(part)
    return substituted


def read_reward_file(path: str) -> Optional[float]:
    """The reward an agent program wrote to STACX_REWARD_FILE: None when it wrote none (no file, or an
    empty one); a JSON number or {"reward": number}; anything else is an error naming the file's content."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(4096)
    except FileNotFoundError:
        return None
    text = raw.decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the agent command wrote {text[:200]!r} to STACX_REWARD_FILE; write a number "
                         "(e.g. 1.0) or a JSON object {\"reward\": 1.0}")
    return float(value)


def _tail(path: str, chars: int) -> str:
    """The end of an output file, undecodable bytes replaced (never a UnicodeDecodeError)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4 * chars))
            return handle.read().decode("utf-8", "replace").strip()[-chars:]
    except OSError:
        return ""


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the program's process group (whatever it started and left behind)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True, kw_only=True)
class AgentCommand:
    """A program as the agent (module doc). `argv` items may hold `{base_url}` and `{task_json}`."""

    argv: tuple[str, ...]
    """The program and its arguments (--agent-command, split like a shell would)."""
    timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    """Seconds one episode's program may run before it and its process group are killed (--agent-timeout)."""
    passed_env: tuple[str, ...] = ()
    """Names of trainer environment variables the program also gets (--agent-env NAME, repeatable)."""
    cwd: Optional[str] = None
    """Working folder of the program (default: the trainer's)."""

    def __post_init__(self):
        if not self.argv:
            raise ValueError("AgentCommand.argv is empty; give the program and its arguments")
        if not self.timeout_s > 0:
            raise ValueError(f"--agent-timeout must be > 0 seconds, got {self.timeout_s!r}")
        bad = [name for name in self.passed_env if not ENV_NAME.match(name)]
        if bad:
            raise ValueError(f"--agent-env {bad[0]!r} is not a variable name; give a name such as HF_TOKEN (its "
                             "value is taken from the trainer's environment)")

    def __call__(self, base_url: str, task: dict, *, api_key: Optional[str] = None) -> Optional[float]:
        task_json = json.dumps(task)
        argv = substitute_placeholders(self.argv, {"base_url": base_url, "task_json": task_json})
        private = tempfile.mkdtemp(prefix="stacx-agent-")  # mode 0700: the trainer's alone
        try:
            reward_file = os.path.join(private, "reward")
            env = agent_environment(base_url, task_json, reward_file, api_key=api_key, passed_env=self.passed_env)
            stdout_path, stderr_path = os.path.join(private, "stdout"), os.path.join(private, "stderr")
            with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
                process = subprocess.Popen(argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                                           stderr=stderr, start_new_session=True)
            try:
                returncode = process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                process.wait()
                raise AgentCommandTimeout(
                    f"agent command {argv[0]} ran past --agent-timeout {self.timeout_s:g} s and was killed; last "
                    f"output: {_tail(stderr_path, STDERR_SHOWN_CHARS) or _tail(stdout_path, STDERR_SHOWN_CHARS)}")
            finally:
                _kill_group(process)  # no process of the episode outlives it
            if returncode == AGENT_INFRASTRUCTURE_EXIT_CODE:  # the program says: not the policy's doing
                raise InfrastructureError("agent_program", f"agent command {argv[0]} exited with {returncode} "
                                          f"(infrastructure failure): {_tail(stderr_path, STDERR_SHOWN_CHARS)}")
            if returncode != 0:
                raise RuntimeError(f"agent command {argv[0]} exited with {returncode}: "
                                   f"{_tail(stderr_path, STDERR_SHOWN_CHARS)}")
            return read_reward_file(reward_file)
        finally:
            shutil.rmtree(private, ignore_errors=True)
