"""Engine failures in a pool (stacx.rollout.engine_health): a dead engine's requests are re-issued and a
launched one restarted, a hung one is noticed by missed health checks or the deadline, an attached one
is set aside until its health check passes, a restarted engine serves only at the pool's weight version,
and too few live engines stop the run naming them. In-process fakes: no server, no thread timing in a verdict."""

from __future__ import annotations

import threading

import pytest

from stacx.rollout.engine_health import (BEHIND, LIVE, OUT, EnginesLost, attach_supervisor,
                                         is_transport_failure, push_failure_action)
from stacx.rollout.engine_pool import EnginePool
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import HttpTransport, RetryPolicy, ServerRequestError, ServerUnavailableError
from stacx.rollout.sections import RolloutSection
from stacx.wire.types import GenerateOutput, GenerateRequest

FAST = RolloutSection(engine_health_interval_s=0.02, engine_deadline_s=30.0, attached_engine_wait_s=0.0)


class FakeEngine(InferenceEngine):
    """Echoes its prompts; `dead` fails every call at the transport, `hang` blocks generate until released."""

    def __init__(self, name: str, version: int = 0):
        self.name, self.version = name, version
        self.dead = False
        self.healthy = True
        self.hang = threading.Event()
        self.release = threading.Event()
        self.generated: list[GenerateRequest] = []
        self.closed = False

    def _check(self):
        if self.dead:
            raise ServerUnavailableError(self.name, "/generate", "-", 5, "ConnectionError: connection refused")

    def generate(self, requests):
        self._check()
        if self.hang.is_set():
            self.release.wait(30)
            raise ServerUnavailableError(self.name, "/generate", "-", 1, "closed")
        self.generated += list(requests)
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
        return self.healthy and not self.dead

    def shutdown(self):
        self.closed = True


def requests_of(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(input_ids=(1, 2 + i)) for i in range(n)]


def pool_of(engines, *, restart=None, settings=FAST) -> EnginePool:
    pool = EnginePool(engines, names=[e.name for e in engines])
    pool.supervise(settings=settings, restart=restart)
    return pool


def test_a_dead_launched_engine_is_restarted_and_its_requests_reissued():
    a, b = FakeEngine("a"), FakeEngine("b")
    b.dead = True
    fresh = FakeEngine("b2")
    pool = pool_of([a, b], restart=lambda index: fresh)
    requests = requests_of(6)
    outputs = pool.generate(requests)
    assert [o.output_ids for o in outputs] == [list(r.input_ids) for r in requests]  # every request answered, in order
    assert b.closed  # its client closed: a request still retrying against it stops
    pool.supervisor.wait_for_restarts()
    metrics = pool.supervisor.metrics()
    assert metrics["rollout/engine_restarts"] == 1.0
    assert metrics["rollout/requests_reissued"] >= 1.0
    # the restarted server loads the checkpoint (version 0), the pool's version: it serves again at once
    assert pool.supervisor.states == [LIVE, LIVE] and pool.engines[1] is fresh
    pool.generate(requests_of(4))
    assert fresh.generated


def test_a_restarted_engine_behind_the_pool_version_waits_for_the_next_push():
    a, b = FakeEngine("a", version=3), FakeEngine("b", version=3)
    fresh = FakeEngine("b2", version=0)
    pool = pool_of([a, b], restart=lambda index: fresh)
    pool.supervisor.confirm_version(3, {0: 3, 1: 3})
    b.dead = True
    pool.generate(requests_of(4))
    pool.supervisor.wait_for_restarts()
    assert pool.supervisor.states == [LIVE, BEHIND]
    pool.generate(requests_of(4))
    assert not fresh.generated  # never serves version 0 beside version 3
    # the next weight push reaches it; once it confirms the pool's version it serves again
    pool.pause()
    targets = pool.supervisor.push_targets()
    assert targets == [0, 1]
    for index in targets:
        pool.engines[index].update_weights([], version=4)
    pool.flush_cache()
    pool.resume()
    versions = pool.weight_versions()
    assert versions == {"a": 4, "b": 4}
    pool.supervisor.confirm_version(4, {0: 4, 1: 4})
    assert pool.supervisor.states == [LIVE, LIVE]
    pool.generate(requests_of(4))
    assert fresh.generated


def test_a_hung_engine_is_noticed_by_missed_health_checks_and_replaced():
    a, b = FakeEngine("a"), FakeEngine("b")
    b.hang.set()
    b.healthy = False  # stops answering, socket open
    fresh = FakeEngine("b2")
    pool = pool_of([a, b], restart=lambda index: fresh)
    try:
        outputs = pool.generate(requests_of(6))
    finally:
        b.release.set()
    assert len(outputs) == 6 and all(o.output_ids for o in outputs)
    assert pool.supervisor.engine_restarts == 1
    assert len(pool.supervisor.failures) == 1 and pool.supervisor.failures[0][0] == "b"
    assert pool.supervisor.failures[0][1].startswith("missed 2 health checks in a row")


def test_a_generation_past_the_deadline_marks_the_engine_hung_even_when_it_answers_health_checks():
    a, b = FakeEngine("a"), FakeEngine("b")
    b.hang.set()  # healthy, but its generation never returns
    settings = RolloutSection(engine_health_interval_s=0.02, engine_deadline_s=0.1, attached_engine_wait_s=0.0)
    pool = pool_of([a, b], settings=settings)  # attached: set aside, not restarted
    try:
        outputs = pool.generate(requests_of(6))
    finally:
        b.release.set()
    assert len(outputs) == 6
    assert pool.supervisor.states[1] == OUT and "deadline of 0.1 s" in pool.supervisor.reasons[1]


def test_an_attached_engine_leaves_the_pool_until_its_health_check_passes():
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = pool_of([a, b])
    b.dead = True
    pool.generate(requests_of(4))
    assert pool.supervisor.states == [LIVE, OUT] and pool.supervisor.metrics()["rollout/engine_restarts"] == 0.0
    b.dead = False
    pool.supervisor._next_probe[1] = 0.0  # its next probe is due
    pool.generate(requests_of(4))
    assert pool.supervisor.states == [LIVE, LIVE]


def test_too_few_live_engines_stop_the_run_naming_the_engine_and_why():
    a, b = FakeEngine("a"), FakeEngine("b")
    a.dead = b.dead = True
    pool = pool_of([a, b])
    with pytest.raises(EnginesLost, match=r"only 0 of 2 rollout engines are live.*--min-live-engines 1.*"
                                          r"a \(out: a generation: server a did not answer /generate.*connection refused"):
        pool.generate(requests_of(4))
    with pytest.raises(ValueError, match="--min-live-engines 3 is more than the 2 rollout engines"):
        attach_supervisor(EnginePool([a, b], names=["a", "b"]), RolloutSection(min_live_engines=3), servers=None,
                          connect=lambda url: None)


def test_a_failed_weight_push_is_retried_on_the_restarted_engine_skipped_when_attached_raised_when_refused():
    a, b = FakeEngine("a"), FakeEngine("b")
    launched = pool_of([a, b], restart=lambda index: FakeEngine("b2"))
    down = ServerUnavailableError("b", "/stacx/update_weights_bucket", "-", 5, "ConnectionError: reset")
    b.dead = True
    assert push_failure_action(launched.supervisor, 1, RuntimeError("ray task failed")) == "raise"
    assert push_failure_action(launched.supervisor, 1, down) == "retry"
    assert launched.supervisor.engine_restarts == 1 and launched.supervisor.states[1] in (LIVE, BEHIND)
    c, d = FakeEngine("c"), FakeEngine("d")
    attached = pool_of([c, d])
    d.dead = True
    assert push_failure_action(attached.supervisor, 1, down) == "skip"
    assert attached.supervisor.update_targets() == [0]
    # a transient failure on an engine that still answers: retried as is, nothing restarted
    assert push_failure_action(attached.supervisor, 0, down) == "retry" and attached.supervisor.states[0] == LIVE
    wrapped = RuntimeError("task failed")
    wrapped.__cause__ = down
    assert is_transport_failure(wrapped) and not is_transport_failure(ServerRequestError("409", 409))


def test_a_closed_transport_stops_retrying():
    transport = HttpTransport("http://127.0.0.1:9", RetryPolicy(timeout_s=1.0, max_attempts=3, backoff_s=0.0))
    transport.close()
    with pytest.raises(ServerUnavailableError, match="the client was closed"):
        transport.get("/health")


def test_an_engine_that_fails_after_the_push_is_left_out_of_the_version_check_and_waits_for_the_next():
    a, b = FakeEngine("a"), FakeEngine("b")
    fresh = FakeEngine("b2", version=0)
    pool = pool_of([a, b], restart=lambda index: fresh)
    pool.pause()
    for index in pool.supervisor.push_targets():
        pool.engines[index].update_weights([], version=1)
    b.dead = True  # dies after taking the push: restarted, it serves version 0
    pool.flush_cache()
    pool.resume()
    assert pool.weight_versions() == {"a": 1}
    pool.supervisor.confirm_version(1, {0: 1})
    assert pool.supervisor.states == [LIVE, BEHIND]
    pool.generate(requests_of(4))
    assert not fresh.generated


def test_an_engine_dead_at_the_pause_is_restarted_takes_the_push_and_serves_again():
    """The `stacx train` case: an engine dies between rollout and weight push; its pause fails, it is restarted
    before the push, takes it, and is live at the new version."""
    a, b = FakeEngine("a"), FakeEngine("b")
    fresh = FakeEngine("b2", version=0)
    pool = pool_of([a, b], restart=lambda index: fresh)
    b.dead = True
    pool.pause()
    targets = pool.supervisor.push_targets()
    assert targets == [0, 1] and pool.supervisor.states == [LIVE, BEHIND]
    for index in targets:
        pool.engines[index].update_weights([], version=1)
    pool.flush_cache()
    pool.resume()
    assert pool.weight_versions() == {"a": 1, "b": 1}
    pool.supervisor.confirm_version(1, {0: 1, 1: 1})
    assert pool.supervisor.states == [LIVE, LIVE] and pool.supervisor.engine_restarts == 1
