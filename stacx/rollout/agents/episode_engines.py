"""Which rollout engine an agent episode talks to: a live one of the run's supervised pool, and another when it fails.

    engines = EpisodeEngines(pool)                       # the RolloutService's EnginePool (with its supervisor)
    with engines.chosen() as (index, url):               # the least-loaded live engine
        ... open a session on url, run the agent, take its turns ...
    engines.failed(index, why)                           # a session call got no answer: set aside (restarted)

An external agent calls the engine's OpenAI endpoint itself, so a single request cannot be moved to another
engine: the episode is the unit that is re-issued. Its session (the recorded turns) lives on the engine, so an
episode whose engine failed is played again from its prompt on a live engine (`rollout/requests_reissued`
counts it). An engine has failed an episode when a session call to it got no answer (connection refused or
reset, a timeout), or when the agent failed and the engine then fails its health check; an agent that failed
while its engine answers failed for its own reasons (its episode ends as before). Spreading episodes over the
live engines also keeps a many-engine run from sending every agent to the first one.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import requests

from stacx.rollout.engine_health import EngineFailed, EngineSupervisor

MAX_REISSUES = 3
"""Times one episode moves to another engine before the step stops, naming the engines' failures."""


class EpisodeEngines:
    """Least-loaded choice among the live engines of a supervised pool, and failure reports (module doc)."""

    def __init__(self, pool: Any):
        """pool: an EnginePool with a supervisor (stacx.rollout.engine_pool); its names are the engines' URLs."""
        if getattr(pool, "supervisor", None) is None:
            raise ValueError("EpisodeEngines needs a supervised EnginePool (EnginePool.supervise)")
        self.pool = pool
        self.supervisor: EngineSupervisor = pool.supervisor
        self._lock = threading.Lock()

    @contextmanager
    def chosen(self) -> Iterator[tuple[int, str]]:
        """(index, URL) of the least-loaded live engine, held for one episode (below --min-live-engines the
        supervisor's `EnginesLost` / `EnginesBehind` is raised)."""
        index = self.pool._acquire(1)
        try:
            yield index, self.pool.names[index]
        finally:
            self.pool._release(index, 1)

    def failed(self, index: int, reason: str) -> EngineFailed:
        """Engine `index` failed an episode: set it aside (restarted when launched), the episode re-issued."""
        error = self.supervisor.fail(index, f"an agent episode: {reason}")
        with self._lock:
            self.supervisor.requests_reissued += 1
        return error

    def answers(self, index: int) -> bool:
        """Whether engine `index` passes its health check (an agent that failed on a healthy engine failed itself)."""
        return self.supervisor._healthy(index)


def is_unanswered(error: BaseException) -> bool:
    """A session call that got no answer from the engine (as opposed to a refused one)."""
    return isinstance(error, (requests.ConnectionError, requests.Timeout))
