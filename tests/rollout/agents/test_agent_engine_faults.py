"""--agent runs go through the supervised engine pool (issue 44): each episode runs on a live engine (spread,
not all on the first), and an episode whose engine died is played again on a live one (counted as re-issued);
an agent that failed on an engine that answers failed for its own reasons. No server: the sessions are faked
per engine URL."""

from __future__ import annotations

import pytest
import requests

from stacx.rollout.agents.agent_rollout import AgentRollout
from stacx.rollout.agents.episode_engines import EpisodeEngines
from stacx.rollout.engine_health import LIVE
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.sections import RolloutSection
from stacx.wire.sample import Sample

FAST = RolloutSection(engine_health_interval_s=0.02, engine_deadline_s=30.0, attached_engine_wait_s=0.0)


class Engine:
    def __init__(self, url):
        self.url, self.dead = url, False

    def health(self):
        return not self.dead

    def shutdown(self):
        pass


class SessionsPerEngine(AgentRollout):
    """Sessions opened and turns taken per engine URL; a dead engine's session calls get no answer."""

    def __init__(self, agent, engines_by_url, pool, **kwargs):
        super().__init__(agent, server_url="http://first", next_tasks=lambda step: [{"prompt": "2+3"}],
                         n_samples_per_task=2, engines=EpisodeEngines(pool), **kwargs)
        self.engines_by_url, self.opened = engines_by_url, []

    def _check(self, url):
        if self.engines_by_url[url].dead:
            raise requests.ConnectionError(f"{url}: connection refused")

    def open_session(self, server_url=None):
        self._check(server_url)
        self.opened.append(server_url)
        return f"s{len(self.opened)}", "secret"

    def take_turns(self, session_id, secret=None, server_url=None):
        self._check(server_url)
        return ["turn"]


@pytest.fixture(autouse=True)
def one_sample_per_session(monkeypatch):
    import stacx.rollout.agents.agent_rollout as agent_rollout

    monkeypatch.setattr(agent_rollout, "assemble_trajectories", lambda turns, group_index, episode_id: [
        Sample(prompt_ids=[1], response_ids=[2], rollout_log_probs=[0.0], loss_mask=[1], executors=[1],
               group_index=group_index,
               episode_id=episode_id, metadata={"num_turns": 1})])


def pool_of(*urls, restart=None):
    engines = [Engine(url) for url in urls]
    pool = EnginePool(engines, names=list(urls))
    pool.supervise(settings=FAST, restart=restart)
    return pool, {engine.url: engine for engine in engines}


def test_episodes_are_spread_over_the_live_engines():
    pool, by_url = pool_of("http://a", "http://b")
    rollout = SessionsPerEngine(lambda base_url, task: 1.0, by_url, pool, max_parallel_episodes=1)
    rollout.collect(0)
    assert sorted(rollout.opened) == ["http://a", "http://b"]  # not both on the first engine


def test_an_episode_whose_engine_is_dead_is_played_again_on_a_live_engine_and_counted():
    pool, by_url = pool_of("http://a", "http://b", restart=lambda index: Engine("http://a"))
    by_url["http://a"].dead = True
    base_urls = []
    rollout = SessionsPerEngine(lambda base_url, task: base_urls.append(base_url) or 1.0, by_url, pool,
                                max_parallel_episodes=1)
    samples, metrics = rollout.collect(0)
    assert len(samples) == 2 and all(s.reward == 1.0 for s in samples)
    assert all(url.startswith("http://b/sessions/") for url in base_urls)
    pool.supervisor.wait_for_restarts()
    assert pool.supervisor.metrics()["rollout/requests_reissued"] == 1.0
    assert pool.supervisor.metrics()["rollout/engine_restarts"] == 1.0


def test_an_agent_that_failed_on_an_engine_that_stopped_answering_moves_on_one_that_answers_stays_failed():
    pool, by_url = pool_of("http://a", "http://b")
    calls = []

    def agent(base_url, task):  # its engine dies under it the first time
        calls.append(base_url)
        if len(calls) == 1:
            by_url[base_url.split("/sessions/")[0]].dead = True
            raise RuntimeError("openai.APIConnectionError: Connection error.")
        return 1.0

    class TurnsKept(SessionsPerEngine):
        def take_turns(self, session_id, secret=None, server_url=None):
            return ["turn"]  # the turns were taken before it died

    rollout = TurnsKept(agent, by_url, pool, max_parallel_episodes=1)
    samples, _ = rollout.collect(0)
    assert [s.reward for s in samples] == [1.0, 1.0] and len(calls) == 3
    assert pool.supervisor.states.count(LIVE) == 1 and pool.supervisor.requests_reissued == 1

    pool, by_url = pool_of("http://a", "http://b")
    mistaken = SessionsPerEngine(lambda base_url, task: 1 / 0, by_url, pool, max_parallel_episodes=1)
    samples, _ = mistaken.collect(0)
    assert all(s.reward == 0.0 and "ZeroDivisionError" in s.reward_error for s in samples)
    assert pool.supervisor.requests_reissued == 0 and pool.supervisor.states == [LIVE, LIVE]


def test_an_agent_rollout_needs_a_supervised_pool():
    with pytest.raises(ValueError, match="supervised EnginePool"):
        EpisodeEngines(EnginePool([Engine("http://a")], names=["http://a"]))
