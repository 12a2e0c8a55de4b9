"""A single-engine run is supervised too (issue 44): a dead engine is restarted, given the current weights
by the trainer when it comes back behind them (`EnginesBehind`), and the run stops when it cannot come back.
In-process fakes: no server; the restart runs in the supervisor's thread and is waited for, never timed."""

from __future__ import annotations


import pytest

from stacx.rollout.engine_health import BEHIND, LIVE, EnginesBehind, EnginesLost
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.registry import register_engine, unregister_engine
from stacx.rollout.plan import RolloutPlan
from stacx.rollout.sections import RolloutSection, TeacherSection
from stacx.rollout.service import RolloutService
from stacx.trainer.loop import StacxTrainer
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import ServerUnavailableError
from stacx.wire.types import GenerateOutput, GenerateRequest

FAST = RolloutSection(engine_health_interval_s=0.02, engine_deadline_s=30.0, attached_engine_wait_s=0.0)


class Engine(InferenceEngine):
    """Echoes its prompts at its weight version; `dead` fails every call at the transport."""

    def __init__(self, url: str = "http://engine", *, api_key=None, version: int = 0):
        self.url, self.version, self.dead = url, version, False

    def _check(self):
        if self.dead:
            raise ServerUnavailableError(self.url, "/generate", "-", 5, "ConnectionError: connection refused")

    def generate(self, requests):
        self._check()
        return [GenerateOutput(output_ids=list(r.input_ids), weight_version=self.version,
                               output_token_versions=[self.version] * len(r.input_ids)) for r in requests]

    def update_weights(self, buckets, *, version):
        self._check()
        self.version = version

    def weight_version(self):
        self._check()
        return self.version

    def pause(self):
        self._check()

    def resume(self):
        self._check()

    def flush_cache(self):
        self._check()

    def health(self):
        return not self.dead

    def shutdown(self):
        pass


REQUESTS = [GenerateRequest(input_ids=(1, 2)), GenerateRequest(input_ids=(3, 4))]


def single(engine, restart):
    pool = EnginePool([engine], names=[engine.url])
    pool.supervise(settings=FAST, restart=restart)
    return pool


def test_a_single_engine_that_dies_before_any_push_is_restarted_and_serves_the_requests_at_once():
    engine, fresh = Engine(), Engine()
    engine.dead = True
    pool = single(engine, restart=lambda index: fresh)
    outputs = pool.generate(REQUESTS)  # waits for the restart: the fresh server loads version 0, the pool's
    assert [o.output_ids for o in outputs] == [[1, 2], [3, 4]] and pool.engines[0] is fresh
    assert pool.supervisor.metrics()["rollout/engine_restarts"] == 1.0


def test_a_single_engine_restarted_after_a_push_needs_the_current_weights_which_a_push_brings():
    engine, fresh = Engine(), Engine()
    pool = single(engine, restart=lambda index: fresh)
    service = RolloutService(pool, engine_kind="http", url=engine.url, tokenizer=None, rollout_section=None)
    service.begin_weight_update()
    assert service.weight_push_urls() == (engine.url,)
    engine.update_weights(iter(()), version=3)  # the trainer's push
    service.finish_weight_update(3)
    engine.dead = True
    with pytest.raises(EnginesBehind, match=r"only 0 of 1 rollout engines are live.*behind.*serves weight "
                                            r"version 0, the pool 3.*current weights are pushed") as behind:
        pool.generate(REQUESTS)
    assert behind.value.version == 3 and pool.supervisor.states == [BEHIND]
    service.begin_weight_update()  # what the trainer does on EnginesBehind (StacxTrainer.shared_batch)
    assert service.weight_push_urls() == (engine.url,)
    fresh.update_weights(iter(()), version=3)
    service.finish_weight_update(3)
    assert pool.supervisor.states == [LIVE]
    assert {o.weight_version for o in pool.generate(REQUESTS)} == {3}


def test_a_single_engine_that_cannot_come_back_stops_the_run_naming_it():
    engine = Engine()
    engine.dead = True

    def restart(index):
        raise RuntimeError("stacx serve exited with status 1")

    with pytest.raises(EnginesLost, match=r"only 0 of 1 .*its restart failed: RuntimeError: stacx serve exited") as lost:
        single(engine, restart).generate(REQUESTS)
    assert not isinstance(lost.value, EnginesBehind)
    attached = Engine()
    attached.dead = True
    with pytest.raises(EnginesLost, match="--min-live-engines 1"):  # attached: set aside, nothing restarts it
        single(attached, None).generate(REQUESTS)


def test_a_run_on_one_launched_engine_gets_a_supervised_pool_that_restarts_its_server():
    restarted = []

    class Servers:
        def wait_until_ready(self):
            return ("http://engine",)

        def restart(self, index):
            restarted.append(index)
            return "http://engine"

        def stop(self):
            pass

    register_engine("fake_single", launcher=lambda launch: Servers())(Engine)
    try:
        service = RolloutService.start(RolloutSection(rollout_engine="fake_single"), TeacherSection(),
                                       plan=RolloutPlan(recipe="grpo", data_source="rollout"), hf_checkpoint="tiny",
                                       tokenizer=object())
    finally:
        unregister_engine("fake_single")
    assert isinstance(service.engine, EnginePool) and service.supervisor is not None
    service.engine.engines[0].dead = True
    assert [o.output_ids for o in service.engine.generate(REQUESTS)] == [[1, 2], [3, 4]]
    assert restarted == [0] and service.fault_metrics()["rollout/engine_restarts"] == 1.0
    service.close()


class Rank:
    def __init__(self, is_driver, shared=()):
        self.is_driver, self.shared = is_driver, list(shared)

    def share(self, value):
        return value if self.is_driver else self.shared.pop(0)


def trainer(channel, samples):
    trainer = object.__new__(StacxTrainer)
    trainer.channel, trainer.samples, trainer.pushed = channel, samples, []
    trainer.push_policy_weights = lambda version: trainer.pushed.append(version)
    trainer.driver_batch = lambda step: samples.collect(step)
    return trainer


class BehindOnce:
    def __init__(self):
        self.calls = 0

    def collect(self, step):
        self.calls += 1
        if self.calls == 1:
            raise EnginesBehind("only 0 of 1 rollout engines are live", version=3)
        return "batch", {"rollout/engine_restarts": 1.0}


def test_the_trainer_pushes_the_current_weights_on_every_rank_and_rolls_the_step_out_again():
    driver = trainer(Rank(True), BehindOnce())
    assert driver.shared_batch(3) == ("batch", {"rollout/engine_restarts": 1.0})
    assert driver.pushed == [3] and driver.samples.calls == 2
    other = trainer(Rank(False, [(None, {"refresh_weights_version": 3.0}), ("batch", {})]), None)
    assert other.shared_batch(3) == ("batch", {}) and other.pushed == [3]  # it takes part in the push


def test_an_engine_that_keeps_coming_back_behind_stops_the_run_after_a_few_refreshes():
    class AlwaysBehind:
        def collect(self, step):
            raise EnginesBehind("only 0 of 1 rollout engines are live", version=3)

    driver = trainer(Rank(True), AlwaysBehind())
    with pytest.raises(EnginesBehind):
        driver.shared_batch(3)
    assert driver.pushed == [3, 3, 3]



def test_a_failure_seen_on_a_client_the_restart_already_replaced_neither_sets_aside_nor_restarts_the_new_engine():
    """Two calls in flight on the one engine when it dies: the first failure restarts it; the second call's
    failure, reported only after the restart finished, is the old server's (the async run's flake: a second
    restart of the fresh engine, or EnginesLost while it was under way). Ordered by hand, never by timing."""
    old, fresh = Engine(), Engine("http://engine-restarted")
    restarts = []
    pool = single(old, restart=lambda index: restarts.append(index) or fresh)
    supervisor = pool.supervisor
    old.dead = True
    with pytest.raises(Exception):
        supervisor.call(0, lambda: old.generate(REQUESTS), client=old)
    supervisor.wait_for_restarts()
    assert pool.engines[0] is fresh and supervisor.states[0] == LIVE
    late = supervisor.call  # the second call captured the old client before the restart
    with pytest.raises(Exception):
        late(0, lambda: old.generate(REQUESTS), client=old)
    supervisor.wait_for_restarts()
    assert restarts == [0] and supervisor.states[0] == LIVE and pool.engines[0] is fresh
    assert supervisor.metrics()["rollout/engine_restarts"] == 1.0
    assert [o.output_ids for o in pool.generate(REQUESTS)] == [[1, 2], [3, 4]]
