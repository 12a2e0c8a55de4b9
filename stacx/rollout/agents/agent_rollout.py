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
/stacx/sessions/<id>` with the secret, stacx.serving.openai_endpoints) and assembles them into
samples (stacx.rollout.agents.agent_trajectories: the ids the engine produced, loss mask 1 on them only; one
sample per branch of the session's tree). All samples of one task share its group index, so GRPO
normalizes over the task's repetitions; all samples of one episode share its `episode_id`, so the
group statistics count each episode once however often it branched.

The agent is a Python callable `(base_url, task) -> reward or None`, or an `AgentCommand` (any
program, stacx.rollout.agents.agent_command: the base URL and the task reach it as arguments or environment
variables, its reward through a private file). Its reward is the episode's: every sample of the session
gets it. An agent that raises (or a command that exits non-zero or runs past its timeout) keeps its
recorded turns, with reward 0.0 and `reward_error` saying what failed; a session with no turns gives no
sample.
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, Union

import requests

from stacx.plugins.discovery import resolve_callable
from stacx.rollout.agents.agent_command import DEFAULT_AGENT_TIMEOUT_S, AgentCommand
from stacx.rollout.agents.agent_trajectories import assemble_trajectories, branch_metrics
from stacx.rollout.agents.episode_engines import MAX_REISSUES, EpisodeEngines, is_unanswered
from stacx.rollout.episode_retry import DROPPED_KEY, EpisodeLossError, infrastructure_cause, replace_dropped_groups
from stacx.rollout.evaluation import RolloutDumper
from stacx.wire.sample import Sample
from stacx.wire.trajectories import RecordedTurn

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


def agent_from_settings(agent: Optional[str], agent_command: Optional[str], *,
                        agent_timeout: float = DEFAULT_AGENT_TIMEOUT_S,
                        agent_env: tuple[str, ...] = ()) -> Union[Agent, AgentCommand]:
    """The run's agent: `--agent file.py:function | module:function`, or `--agent-command "program args"`
    (with --agent-timeout and --agent-env, stacx.rollout.agents.agent_command)."""
    if agent and agent_command:
        raise ValueError("--agent and --agent-command are both set; give one (a Python function, or a program)")
    if agent:
        return resolve_callable(agent, flag="--agent")
    if agent_command:
        return AgentCommand(argv=tuple(shlex.split(agent_command)), timeout_s=float(agent_timeout),
                            passed_env=tuple(agent_env))
    raise ValueError("no agent: set --agent file.py:function or --agent-command 'program args'")


def last_turn_reward(reward_fn: Callable[[str, object, dict], float], decode: Callable[[Sequence[int]], str]) -> RewardFn:
    """An episode reward from a run's reward function (`--reward-fn`): the last sample's last turn,
    decoded, against the task's label and metadata."""

    def score(task: dict, samples: Sequence[Sample]) -> float:
        last = samples[-1]
        answer = decode(last.response_ids[last.metadata.get("last_turn_start", 0):])
        return float(reward_fn(answer, task.get("label"), task.get("metadata") or {}))

    return score


class RunningEpisodes:
    """The agent, noting which episodes run since when: `describe()` names the ones a step waits for (the
    run's heartbeat prints it, so a hung agent is seen by its task)."""

    SHOWN = 4
    """Tasks named at most; the others are counted."""

    def __init__(self, agent: Union[Agent, AgentCommand]):
        self.agent = agent
        self._lock = threading.Lock()
        self._running: dict[int, tuple[float, str]] = {}
        self._next = 0

    def __call__(self, base_url: str, task: dict) -> Optional[float]:
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._running[key] = (time.monotonic(), str(task.get("source") or task.get("label") or "a task"))
        try:
            return self.agent(base_url, task)
        finally:
            with self._lock:
                del self._running[key]

    def describe(self, now: Optional[float] = None) -> str:
        """'' when no episode runs; else e.g. 'waiting for 3 agent episodes: rows.jsonl:4 (2 episodes, 640 s),
        rows.jsonl:9 (610 s)', the longest-running tasks first."""
        now = time.monotonic() if now is None else now
        with self._lock:
            running = list(self._running.values())
        if not running:
            return ""
        by_task: dict[str, list[float]] = {}
        for started, name in running:
            by_task.setdefault(name, []).append(now - started)
        ordered = sorted(by_task.items(), key=lambda item: -max(item[1]))
        named = [f"{name} ({len(ages)} episodes, {max(ages):.0f} s)" if len(ages) > 1 else f"{name} ({ages[0]:.0f} s)"
                 for name, ages in ordered[:self.SHOWN]]
        more = f" and {len(ordered) - self.SHOWN} more tasks" if len(ordered) > self.SHOWN else ""
        plural = "s" if len(running) > 1 else ""
        return f"waiting for {len(running)} agent episode{plural}: {', '.join(named)}{more}"


class AgentRollout:
    """A rollout source whose samples are an external agent's sessions (module doc); it answers
    `collect(step)` and `evaluate_if_due(step)` as StepRollout does."""

    def __init__(self, agent: Union[Agent, AgentCommand], *, server_url: str,
                 next_tasks: Callable[[int], Sequence[dict]], n_samples_per_task: int = 1,
                 reward_fn: Optional[RewardFn] = None, max_parallel_episodes: int = 8, request_timeout_s: float = 60.0,
                 api_key: Optional[str] = None, dumper: Optional[RolloutDumper] = None,
                 uniform_reward_warning: Optional[Callable[[int, Sequence[Sample]], Optional[str]]] = None,
                 episode_retries: int = 0, max_dropped_fraction: float = 1.0,
                 more_tasks: Optional[Callable[[int, int], Sequence[dict]]] = None,
                 engines: Optional[EpisodeEngines] = None):
        if n_samples_per_task < 1:
            raise ValueError(f"n_samples_per_task must be >= 1, got {n_samples_per_task}")
        if max_parallel_episodes < 1:
            raise ValueError(f"max_parallel_episodes must be >= 1, got {max_parallel_episodes}")
        self.running = RunningEpisodes(agent)
        self.agent = self.running  # the agent itself, its running episodes noted (`waiting_for`)
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
        self.episode_retries = episode_retries
        """Times an episode whose agent failed for an infrastructure reason is played again."""
        self.episodes_retried = 0
        self.max_dropped_fraction = max_dropped_fraction
        """A step whose dropped episodes exceed this fraction stops the run (--max-dropped-fraction)."""
        self.more_tasks = more_tasks
        """(step, k) -> k fresh tasks, which replace the tasks whose groups lost an episode."""
        self.engines = engines
        """The run's supervised engines: each episode runs on a live one and moves when it fails
        (stacx.rollout.agents.episode_engines); None: every episode talks to `server_url`."""

    def waiting_for(self) -> str:
        """The episodes still running ('' when none), for the run's heartbeat (RunningEpisodes.describe)."""
        return self.running.describe()

    def collect(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The samples of every task of `step` x n_samples_per_task episodes, and rollout metrics."""
        tasks = list(self.next_tasks(step))
        if not tasks:
            raise ValueError(f"step {step}: next_tasks gave no task")
        episodes = [(index, task) for index, task in enumerate(tasks) for _ in range(self.n_samples_per_task)]
        retried_before = self.episodes_retried
        results = self.play(episodes)
        next_episode_id = [len(episodes)]

        def fresh(num_tasks: int) -> list[Sample]:
            played = self.play_fresh(step, num_tasks, next_episode_id[0])
            next_episode_id[0] += num_tasks * self.n_samples_per_task
            return played

        played = [sample for result in results for sample in result]
        if not played:
            raise RuntimeError(f"step {step}: none of the {len(episodes)} agent episodes made a model call through "
                               f"its base URL ({session_base_url(self.server_url, '<session>')}); check that the "
                               "agent uses the base_url it is given")
        samples, replaced = replace_dropped_groups(played, fresh, num_groups=len(tasks), step=step,
                                                   max_dropped_fraction=self.max_dropped_fraction)
        failed = sum(any(s.reward_error for s in result) for result in results)
        # One reward per episode (every sample of an episode, one per branch, carries it): the mean over
        # episodes, not over samples, so an episode that branched weighs as much as one that did not.
        episode_rewards = [float(result[0].reward or 0.0) for result in results if result]
        metrics = {"rollout/agent_episodes": float(len(episodes)), "rollout/agent_failed_episodes": float(failed),
                   "rollout/agent_samples": float(len(samples)),
                   "rollout/agent_turns_mean": sum(s.metadata["num_turns"] for s in samples) / len(samples),
                   "rollout/reward_mean": sum(episode_rewards) / len(episode_rewards),
                   "rollout/episodes_retried": float(self.episodes_retried - retried_before), **replaced,
                   **branch_metrics(results)}
        self.report(step, samples)
        return samples, metrics

    def play(self, episodes: Sequence[tuple[int, dict]], first_episode_id: int = 0) -> list[list[Sample]]:
        """Each (group index, task) episode's samples, `max_parallel_episodes` at once."""
        with ThreadPoolExecutor(max_workers=min(self.max_parallel_episodes, len(episodes))) as pool:
            return list(pool.map(lambda episode: self.run_episode(*episode[1], episode_id=first_episode_id + episode[0]),
                                 enumerate(episodes)))

    def play_fresh(self, step: int, num_tasks: int, first_episode_id: int) -> list[Sample]:
        """The samples of `num_tasks` fresh tasks (replacing groups with a dropped episode), episode ids unique."""
        if self.more_tasks is None:
            raise EpisodeLossError(f"step {step}: {num_tasks} task(s) had an episode dropped after its retries, and "
                                   "this rollout has no source of fresh tasks to replace them (AgentRollout(more_tasks=))")
        tasks = list(self.more_tasks(step, num_tasks))
        episodes = [(index, task) for index, task in enumerate(tasks) for _ in range(self.n_samples_per_task)]
        return [sample for result in self.play(episodes, first_episode_id) for sample in result]

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
        """One episode -> its samples; an episode whose agent failed for an infrastructure reason is played
        again, up to `episode_retries` times (stacx.rollout.episode_retry); then its samples are marked dropped."""
        for attempt in range(self.episode_retries + 1):
            samples = self.play_episode(group_index, task, episode_id=episode_id)
            failure = next((s.metadata.get("infrastructure_failure") for s in samples), None)
            if failure is None:
                return samples
            if attempt < self.episode_retries:
                self.episodes_retried += 1
                logger.warning("agent episode on task %d failed for an infrastructure reason (%s); playing it again",
                               group_index, failure)
        for sample in samples:
            sample.metadata[DROPPED_KEY] = failure
        return samples

    def play_episode(self, group_index: int, task: dict, *, episode_id: Optional[int] = None) -> list[Sample]:
        """One episode in a fresh session -> its samples (one per branch), each with the episode's reward. With
        `engines`, on a live engine, played again on another when that one fails (episode_engines)."""
        if self.engines is None:
            return self.play_on(self.server_url, group_index, task, episode_id=episode_id)
        failures = []
        while len(failures) <= MAX_REISSUES:
            with self.engines.chosen() as (index, url):
                try:
                    samples = self.play_on(url, group_index, task, episode_id=episode_id)
                except Exception as err:  # noqa: BLE001 - a session call to a dead engine; others raised as is
                    if not is_unanswered(err):
                        raise
                    failures.append(str(self.engines.failed(index, f"{type(err).__name__}: {err}")))
                    continue
                failed = next((s.reward_error for s in samples if s.reward_error), None)
                if failed is None or self.engines.answers(index):
                    return samples
                failures.append(str(self.engines.failed(index, f"the agent failed ({failed}) and the engine "
                                                               "does not answer its health check")))
            logger.warning("agent episode on task %d: %s; playing it again on a live engine", group_index, failures[-1])
        raise RuntimeError(f"an agent episode on task {group_index} lost its engine {len(failures)} times in a row: "
                           + "; ".join(failures) + ". Check the rollout servers' logs")

    def play_on(self, server_url: str, group_index: int, task: dict, *,
                episode_id: Optional[int] = None) -> list[Sample]:
        """One episode in a fresh session on the server at `server_url` (play_episode)."""
        session_id, secret = self.open_session(server_url)
        reward, error, cause = None, None, None
        try:
            reward = self.agent(session_base_url(server_url, session_id, secret), task)
        except Exception as err:  # noqa: BLE001 - one failing episode must not end the run
            error = f"{type(err).__name__}: {err}"
            logger.warning("agent episode on task %d failed: %s", group_index, error)
            cause = infrastructure_cause(err)
        samples = assemble_trajectories(self.take_turns(session_id, secret, server_url), group_index=group_index,
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
            if cause is not None:
                sample.metadata["infrastructure_failure"] = f"{cause}: {error}"
        return samples

    def open_session(self, server_url: Optional[str] = None) -> tuple[str, str]:
        """(a new session id, its secret): opened on the server (default `server_url`) before the agent starts,
        so only this episode can use it and the server keeps it until `take_turns`."""
        server_url = (server_url or self.server_url).rstrip("/")
        session_id = uuid.uuid4().hex
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        answer = requests.post(f"{server_url}/stacx/sessions/{session_id}", headers=headers,
                               timeout=self.request_timeout_s)
        if answer.status_code in (401, 403):
            raise RuntimeError(f"{server_url} refused to open an episode's session ({answer.status_code}): "
                               "pass AgentRollout(api_key=) the server's API key (stacx serve --api-key / "
                               "STACX_API_KEY)")
        answer.raise_for_status()
        return session_id, answer.json()["secret"]

    def take_turns(self, session_id: str, secret: Optional[str] = None,
                   server_url: Optional[str] = None) -> list[RecordedTurn]:
        """The session's recorded turns, removed from the server (default `server_url`)."""
        headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
        server_url = (server_url or self.server_url).rstrip("/")
        answer = requests.delete(f"{server_url}/stacx/sessions/{session_id}", headers=headers,
                                 timeout=self.request_timeout_s)
        answer.raise_for_status()
        return [RecordedTurn.from_json(row) for row in answer.json()["turns"]]
