"""Bring your own scaffold: an external agent, given a base URL and a task, is the rollout.

    def my_agent(base_url: str, task: dict) -> float | None:       # any code that takes a base_url
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        ...                                                         # as many turns and tool calls as it likes
        return reward                                               # or None: `reward_fn` scores it

    rollout = AgentRollout(my_agent, server_url=engine_url, next_tasks=lambda step: tasks, n_samples_per_task=4)
    samples, metrics = rollout.collect(step)                        # what StepRollout.collect returns

For each task and repetition, `collect` opens a fresh session on the server (a new id; `POST
/stacx/sessions/<id>` gives it a secret, and the server never evicts it while the episode runs), runs
the agent against `<server_url>/sessions/<id>/<secret>/v1` (no other client can write, read or pop
that session), then takes the session's recorded turns from the server (`DELETE
/stacx/sessions/<id>` with the secret, stacx.rollout.engines.openai_endpoints) and assembles them into
samples (stacx.rollout.agent_trajectories: the ids the engine produced, loss mask 1 on them only; one
sample per branch of the session's tree). All samples of one task share its group index, so GRPO
normalizes over the task's repetitions; all samples of one episode share its `episode_id`, so the
group statistics count each episode once however often it branched.

The agent is a Python callable `(base_url, task) -> reward or None`, or an `AgentCommand` (any
program: the base URL and the task reach it as arguments or environment variables). Its reward is
the episode's: every sample of the session gets it. An agent that raises (or a command that exits
non-zero) keeps its recorded turns, with reward 0.0 and `reward_error` saying what failed; a session
with no turns gives no sample.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import requests

from stacx.objectives.discovery import resolve_callable
from stacx.rollout.agent_trajectories import RecordedTurn, assemble_trajectories, branch_metrics
from stacx.rollout.evaluation import RolloutDumper
from stacx.rollout.manager import Sample

__all__ = ["Agent", "AgentCommand", "AgentRollout", "agent_from_settings", "last_turn_reward", "session_base_url"]

logger = logging.getLogger(__name__)

Agent = Callable[[str, dict], Optional[float]]
"""(base_url, task) -> the episode's reward, or None when `reward_fn` scores it."""
RewardFn = Callable[[dict, Sequence[Sample]], float]
"""(task, the session's samples) -> the episode's reward."""


def session_base_url(server_url: str, session_id: str, secret: Optional[str] = None) -> str:
    """The OpenAI base URL that records turns under `session_id` (opened with `secret`, when given)."""
    where = session_id if secret is None else f"{session_id}/{secret}"
    return f"{server_url.rstrip('/')}/sessions/{where}/v1"


@dataclass(frozen=True, kw_only=True)
class AgentCommand:
    """A program as the agent. `argv` items may hold `{base_url}` and `{task_json}`; the program also
    gets OPENAI_BASE_URL, OPENAI_API_KEY (unused by the server, set because clients require one), the
    same for Anthropic clients (ANTHROPIC_BASE_URL, the session's URL without `/v1`, and
    ANTHROPIC_API_KEY) and STACX_TASK (the task as JSON) in its environment. If its last line of standard output is a JSON
    object with a "reward" number, that is the episode's reward."""

    argv: tuple[str, ...]
    timeout_s: float = 3600.0
    cwd: Optional[str] = None

    def __post_init__(self):
        if not self.argv:
            raise ValueError("AgentCommand.argv is empty; give the program and its arguments")

    def __call__(self, base_url: str, task: dict) -> Optional[float]:
        task_json = json.dumps(task)
        # replaced literally (not str.format): an inline script's own braces stay as they are
        argv = [part.replace("{base_url}", base_url).replace("{task_json}", task_json) for part in self.argv]
        env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=os.environ.get("OPENAI_API_KEY", "stacx"),
                   ANTHROPIC_BASE_URL=base_url.removesuffix("/v1"),  # Anthropic clients add /v1/messages
                   ANTHROPIC_API_KEY=os.environ.get("ANTHROPIC_API_KEY", "stacx"), STACX_TASK=task_json)
        done = subprocess.run(argv, env=env, cwd=self.cwd, capture_output=True, text=True, timeout=self.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"agent command {argv[0]} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        lines = done.stdout.strip().splitlines()
        try:
            last = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            return None
        reward = last.get("reward") if isinstance(last, dict) else None
        return float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None


def agent_from_settings(agent: Optional[str], agent_command: Optional[str]) -> Union[Agent, AgentCommand]:
    """The run's agent: `--agent file.py:function | module:function`, or `--agent-command "program args"`."""
    if agent and agent_command:
        raise ValueError("--agent and --agent-command are both set; give one (a Python function, or a program)")
    if agent:
        return resolve_callable(agent, flag="--agent")
    if agent_command:
        return AgentCommand(argv=tuple(shlex.split(agent_command)))
    raise ValueError("no agent: set --agent file.py:function or --agent-command 'program args'")


def last_turn_reward(reward_fn: Callable[[str, object, dict], float], decode: Callable[[Sequence[int]], str]) -> RewardFn:
    """An episode reward from a run's reward function (`--reward-fn`): the last sample's last turn,
    decoded, against the task's label and metadata."""

    def score(task: dict, samples: Sequence[Sample]) -> float:
        last = samples[-1]
        answer = decode(last.response_ids[last.metadata.get("last_turn_start", 0):])
        return float(reward_fn(answer, task.get("label"), task.get("metadata") or {}))

    return score


class AgentRollout:
    """A rollout source whose samples are an external agent's sessions (module doc); it answers
    `collect(step)` and `evaluate_if_due(step)` as StepRollout does."""

    def __init__(self, agent: Union[Agent, AgentCommand], *, server_url: str,
                 next_tasks: Callable[[int], Sequence[dict]], n_samples_per_task: int = 1,
                 reward_fn: Optional[RewardFn] = None, max_parallel_episodes: int = 8, request_timeout_s: float = 60.0,
                 api_key: Optional[str] = None, dumper: Optional[RolloutDumper] = None,
                 uniform_reward_warning: Optional[Callable[[int, Sequence[Sample]], Optional[str]]] = None):
        if n_samples_per_task < 1:
            raise ValueError(f"n_samples_per_task must be >= 1, got {n_samples_per_task}")
        if max_parallel_episodes < 1:
            raise ValueError(f"max_parallel_episodes must be >= 1, got {max_parallel_episodes}")
        self.agent = agent
        self.server_url = server_url.rstrip("/")
        self.next_tasks = next_tasks
        self.n_samples_per_task = n_samples_per_task
        self.reward_fn = reward_fn
        self.max_parallel_episodes = max_parallel_episodes
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key
        """The server's API key (it opens sessions); None for a server without one."""
        self.dumper = dumper
        """Writes the first samples of each step (the episodes' turns, tool calls, observations, reward) to
        rollouts.jsonl, as every other run does (--save-rollouts-per-step)."""
        self.uniform_reward_warning = uniform_reward_warning
        """(step, samples) -> the warning when every task's episodes earned the same reward, else None
        (stacx.rollout.step_rollout.uniform_reward_warning); logged once per run."""
        self.warned_uniform_rewards = False

    def collect(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The samples of every task of `step` x n_samples_per_task episodes, and rollout metrics."""
        tasks = list(self.next_tasks(step))
        if not tasks:
            raise ValueError(f"step {step}: next_tasks gave no task")
        episodes = [(index, task) for index, task in enumerate(tasks) for _ in range(self.n_samples_per_task)]
        with ThreadPoolExecutor(max_workers=min(self.max_parallel_episodes, len(episodes))) as pool:
            results = list(pool.map(lambda episode: self.run_episode(*episode[1], episode_id=episode[0]),
                                    enumerate(episodes)))
        samples = [sample for result in results for sample in result]
        if not samples:
            raise RuntimeError(f"step {step}: none of the {len(episodes)} agent episodes made a model call through "
                               f"its base URL ({session_base_url(self.server_url, '<session>')}); check that the "
                               "agent uses the base_url it is given")
        failed = sum(any(s.reward_error for s in result) for result in results)
        # One reward per episode (every sample of an episode, one per branch, carries it): the mean over
        # episodes, not over samples, so an episode that branched weighs as much as one that did not.
        episode_rewards = [float(result[0].reward or 0.0) for result in results if result]
        metrics = {"rollout/agent_episodes": float(len(episodes)), "rollout/agent_failed_episodes": float(failed),
                   "rollout/agent_samples": float(len(samples)),
                   "rollout/agent_turns_mean": sum(s.metadata["num_turns"] for s in samples) / len(samples),
                   "rollout/reward_mean": sum(episode_rewards) / len(episode_rewards),
                   **branch_metrics(results)}
        self.report(step, samples)
        return samples, metrics

    def report(self, step: int, samples: Sequence[Sample]) -> None:
        """The uniform-reward warning (once per run) and the rollout dump of the step's samples."""
        if self.uniform_reward_warning is not None and not self.warned_uniform_rewards:
            message = self.uniform_reward_warning(step, samples)
            if message is not None:
                self.warned_uniform_rewards = True
                logger.warning(message)
        if self.dumper is not None:
            self.dumper.write(step, samples)

    def evaluate_if_due(self, completed_steps: int) -> dict[str, float]:
        return {}

    def run_episode(self, group_index: int, task: dict, *, episode_id: Optional[int] = None) -> list[Sample]:
        """One episode in a fresh session -> its samples (one per branch), each with the episode's reward."""
        session_id, secret = self.open_session()
        reward, error = None, None
        try:
            reward = self.agent(session_base_url(self.server_url, session_id, secret), task)
        except Exception as err:  # noqa: BLE001 - one failing episode must not end the run
            error = f"{type(err).__name__}: {err}"
            logger.warning("agent episode on task %d failed: %s", group_index, error)
        samples = assemble_trajectories(self.take_turns(session_id, secret), group_index=group_index,
                                        episode_id=episode_id)
        if samples and error is None and reward is None:
            if self.reward_fn is None:
                raise ValueError("the agent returned no reward and AgentRollout has no reward_fn; return the "
                                 "episode's reward from the agent or pass reward_fn=(task, samples) -> float")
            reward = float(self.reward_fn(task, samples))
        for sample in samples:
            sample.reward = 0.0 if error is not None else float(reward)
            sample.reward_error = error
            sample.metadata.update(session_id=session_id, task=task)
        return samples

    def open_session(self) -> tuple[str, str]:
        """(a new session id, its secret): opened on the server before the agent starts, so only this
        episode can use it and the server keeps it until `take_turns`."""
        session_id = uuid.uuid4().hex
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        answer = requests.post(f"{self.server_url}/stacx/sessions/{session_id}", headers=headers,
                               timeout=self.request_timeout_s)
        if answer.status_code in (401, 403):
            raise RuntimeError(f"{self.server_url} refused to open an episode's session ({answer.status_code}): "
                               "pass AgentRollout(api_key=) the server's API key (stacx serve --api-key / "
                               "STACX_API_KEY)")
        answer.raise_for_status()
        return session_id, answer.json()["secret"]

    def take_turns(self, session_id: str, secret: Optional[str] = None) -> list[RecordedTurn]:
        """The session's recorded turns, removed from the server."""
        headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
        answer = requests.delete(f"{self.server_url}/stacx/sessions/{session_id}", headers=headers,
                                 timeout=self.request_timeout_s)
        answer.raise_for_status()
        return [RecordedTurn.from_json(row) for row in answer.json()["turns"]]
