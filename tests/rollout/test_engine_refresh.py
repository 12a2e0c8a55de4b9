"""A run's only engine dies mid-run, is restarted serving its start weights, and gets the current weights from the
trainer (issue 44): the run goes on, and trains exactly what an uninterrupted run trains.

In-process: a real `StacxTrainer`, `RolloutService`, supervised `EnginePool` and (async) `AsyncRollout` over the
scripted engine of the async loop tests (seeded tokens that depend on the weight version it serves) and its digest
policy (the "loss" and "weights" digest every batch trained). The engine dies at its first generation under a given
weight version; its restart (a fresh scripted engine at version 0) runs in the supervisor's thread and is waited
for, never timed. Whatever the thread timing, the tokens depend only on the prompt's seed and the served version,
so the verdicts (bitwise losses and weights) do not.
"""

from __future__ import annotations

import dataclasses

from stacx.rollout.asynchronous.async_scheduler import AsyncRolloutConfig, AsyncRolloutScheduler
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.sections import RolloutSection
from stacx.rollout.service import RolloutService
from stacx.trainer.config.run import RunConfig
from stacx.wire.http_client import ServerUnavailableError
from tests.trainer.fakes import make_trainer
from tests.trainer.test_loop_async import TOKENIZER, DigestPolicy, Prompts, ScriptedEngine, _no_producer_threads
from tests.trainer.test_loop_mini_batches import RecordingLogger

URL = "http://engine"
FAST = RolloutSection(engine_health_interval_s=0.05, engine_deadline_s=60.0, attached_engine_wait_s=0.0)


class DiesAtVersion(ScriptedEngine):
    """A scripted engine whose process dies at its first generation under weight version `version`."""

    def __init__(self, version: int):
        super().__init__()
        self.dies_at, self.dead = version, False

    def generate(self, requests):
        if self.dead or self.version == self.dies_at:
            self.dead = True
            raise ServerUnavailableError(URL, "/generate", "-", 3, "ConnectionError: connection refused")
        return super().generate(requests)

    def health(self):
        return not self.dead


class ComesBack(DiesAtVersion):
    """An attached server that dies at `version` and is back (restarted by its owner: version 0) when the pool's
    health probe asks for the second time."""

    def __init__(self, version: int):
        super().__init__(version)
        self.probes = 0

    def health(self):
        if self.dead:
            self.probes += 1
            if self.probes == 2:
                self.dead, self.dies_at, self.version = False, None, 0
        return not self.dead


class PoolEngine:
    """What the digest policy pushes to: the pool's current engine (a restart replaces the client)."""

    def __init__(self, pool: EnginePool):
        self.pool, self.pushed = pool, []

    def update_weights(self, buckets, *, version):
        self.pushed.append(version)
        self.pool.engines[0].update_weights(buckets, version=version)


def run(mode: str, *, dies_at: int | None, num_steps: int = 4, attached: bool = False, rollout_batch_size: int = 2,
        settings: RolloutSection = FAST):
    """(metrics rows, policy, pool) of a run over one supervised engine that dies at `dies_at` (None: never);
    attached: the run cannot restart it, it comes back by itself (`ComesBack`)."""
    config = RunConfig.from_dict({
        "num_steps": num_steps, "rollout_batch_size": rollout_batch_size, "n_samples_per_prompt": 3, "rollout_max_response_len": 6,
        "save_rollouts_per_step": 0, "rollout_mode": mode, "max_staleness": 0,
        "reward_fn": "tests.trainer.test_loop_async:varied_reward"})
    engine = (ComesBack if attached else DiesAtVersion)(dies_at) if dies_at is not None else ScriptedEngine()
    pool = EnginePool([engine], names=[URL])
    if attached:
        pool.supervise(settings=dataclasses.replace(FAST, attached_engine_wait_s=60.0), restart=None)
    else:
        pool.supervise(settings=settings, restart=lambda index: ScriptedEngine())  # a fresh server serves version 0
    policy = DigestPolicy(PoolEngine(pool))
    service = RolloutService(pool, engine_kind="cpu", url=URL, tokenizer=TOKENIZER, rollout_section=config.rollout)
    trainer = make_trainer("grpo", roles={"policy": policy}, run_config=config, rollout=service, data=Prompts(2))
    logger = RecordingLogger()
    trainer.make_metrics_logger = lambda start: logger
    policy.trainer = trainer
    trainer.run()
    return [row for _, row in logger.rows], policy, pool


def test_a_refreshed_synchronous_step_replays_its_own_prompts_and_trains_what_an_uninterrupted_run_trains():
    plain_rows, plain_policy, _ = run("sync", dies_at=None)
    rows, policy, pool = run("sync", dies_at=2)
    assert pool.supervisor.engine_restarts == 1 and not isinstance(pool.engines[0], DiesAtVersion)
    assert [row["rollout/engine_restarts"] for row in rows] == [0.0, 0.0, 1.0, 1.0]
    assert policy.engine.pushed == [1, 2, 2, 3, 4]  # version 2 again: the restarted engine's refresh
    # the same prompts, seeds and weight versions in every step: bitwise the same losses and weights
    assert [row["policy/loss"] for row in rows] == [row["policy/loss"] for row in plain_rows]
    assert policy.weights == plain_policy.weights
    assert [row["rollout/weight_version"] for row in rows] == [0.0, 1.0, 2.0, 3.0]
    assert len({row["policy/loss"] for row in rows}) == 4  # not trivial: every step trained other samples


def test_an_async_run_on_one_engine_refreshes_the_restarted_engine_and_trains_what_an_uninterrupted_run_trains():
    # --max-staleness 0: the async schedule trains the sync run's batches, so the uninterrupted sync run is the
    # reference; the engine dies under version 2, when step 2's groups are on it and the trainer waits for it.
    # Two groups a step: both calls can fail on the dead engine, the second after its restart finished; that
    # failure is the old client's and restarts nothing (EngineSupervisor.fail's `client`).
    plain_rows, plain_policy, _ = run("sync", dies_at=None)
    rows, policy, pool = run("async", dies_at=2)
    assert pool.supervisor.engine_restarts == 1 and not isinstance(pool.engines[0], DiesAtVersion)
    assert rows[-1]["rollout/engine_restarts"] == pool.supervisor.engine_restarts
    assert policy.engine.pushed.count(2) >= 2  # the published version again: the restarted engine's refresh
    assert [row["policy/loss"] for row in rows] == [row["policy/loss"] for row in plain_rows]
    assert policy.weights == plain_policy.weights
    assert [row["rollout/weight_version"] for row in rows] == [0.0, 1.0, 2.0, 3.0]
    assert max(row["async/staleness_max"] for row in rows) == 0.0
    assert _no_producer_threads()


def test_a_set_aside_group_waits_for_the_refresh_and_keeps_its_deadline_without_partial_rollout():
    scheduler = AsyncRolloutScheduler(AsyncRolloutConfig(max_staleness=0, groups_per_step=1))
    group = scheduler.admit("prompt")
    scheduler.begin_update()  # what the producer does before setting a group aside
    scheduler.set_aside(group, "its requests")
    assert scheduler.pop_continuation() is None and not scheduler.can_admit()  # nothing before the refresh
    scheduler.end_update()  # the published version pushed again
    continued = scheduler.pop_continuation()
    assert (continued.group_id, continued.state, continued.admit_version) == (group, "its requests", 0)
    scheduler.complete(group, ["sample"], [[0, 0]])
    assert scheduler.take_batch(0, timeout=0).groups[0].result == ["sample"]
    assert scheduler.metrics()["async/interrupts_total"] == 0.0  # not an interruption at a weight update


def test_a_run_on_one_attached_engine_waits_for_it_and_pushes_it_the_current_weights_when_it_is_back():
    plain_rows, plain_policy, _ = run("sync", dies_at=None)
    rows, policy, pool = run("sync", dies_at=2, attached=True)
    assert pool.engines[0].probes == 2 and pool.supervisor.engine_restarts == 0  # waited for, not restarted
    assert policy.engine.pushed == [1, 2, 2, 3, 4]  # version 2 again: the server came back serving version 0
    assert [row["policy/loss"] for row in rows] == [row["policy/loss"] for row in plain_rows]
    assert policy.weights == plain_policy.weights
