"""A weight push that fails on one engine under torchrun is retried on it, as on Ray (issue 44).

The sending rank drains its buckets after the engine failed (the other ranks' gathers stay matched), every
rank's outcome is gathered and every rank raises the same error, and the loop's driver decides (retry, skip,
raise) for every rank. In-process: fake ranks, fake engine clients, no process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import stacx.trainer.runtime.role_runtime as role_runtime
from stacx.rollout.engine_health import is_transport_failure
from stacx.trainer.runtime.push_outcome import WeightPushFailed, push_outcome, settle_push
from stacx.trainer.loop import StacxTrainer
from stacx.trainer.runtime.role_runtime import RoleRuntime
from stacx.wire.http_client import ServerUnavailableError
from stacx.wire.types import EngineTarget


def unanswered(url="http://engine-1"):
    return ServerUnavailableError(url, "/update_weights", "-", 3, "ConnectionError: connection refused")


def test_every_rank_raises_the_same_error_when_one_ranks_push_failed():
    def fails():
        raise unanswered()

    outcomes = [push_outcome(fails), push_outcome(lambda: 0)]  # rank 0 sends, rank 1 only gathers
    assert outcomes[1] == {"sent": 0, "error": None, "transport": False}
    with pytest.raises(WeightPushFailed, match="rank 0: ServerUnavailableError") as raised:
        settle_push(outcomes, url="http://engine-1")
    assert raised.value.transport_failure and is_transport_failure(raised.value)
    refused = push_outcome(lambda: (_ for _ in ()).throw(ValueError("tensor shape mismatch")))
    with pytest.raises(WeightPushFailed) as raised:
        settle_push([refused, outcomes[1]], url="http://engine-1")
    assert not raised.value.transport_failure and not is_transport_failure(raised.value)  # never retried
    assert settle_push([{"sent": 7, "error": None, "transport": False}, outcomes[1]], url="u") == [7, 0]


class FailingClient:
    """Takes `fail_at` buckets, then the connection breaks."""

    def __init__(self, fail_at: int):
        self.fail_at, self.taken, self.closed = fail_at, 0, False

    def update_weights(self, buckets, *, version):
        for _ in buckets:
            self.taken += 1
            if self.taken == self.fail_at:
                raise unanswered()

    def shutdown(self):
        self.closed = True


def sending_rank(buckets, client, monkeypatch):
    monkeypatch.setattr(role_runtime, "engine_client", lambda kind, url, api_key=None: client)
    groups = SimpleNamespace(cp_rank=0, dp_rank=0, tp_rank=0, pp_rank=0, ep_size=1)
    return SimpleNamespace(groups=groups, _engine_clients={}, weight_buckets=lambda bucket_bytes: buckets)


def test_the_sender_drains_its_buckets_after_the_engine_failed_so_the_other_ranks_gathers_stay_matched(monkeypatch):
    gathered = []

    def buckets():  # each bucket is one gather with the other TP ranks
        for index in range(5):
            gathered.append(index)
            yield [(f"w{index}", None)]

    client = FailingClient(fail_at=2)
    rank = sending_rank(buckets(), client, monkeypatch)
    with pytest.raises(ServerUnavailableError):
        RoleRuntime.push_weights_to_engine(rank, "cpu", "http://engine-1", 3, 1 << 20)
    assert gathered == [0, 1, 2, 3, 4] and client.taken == 2
    assert client.closed and rank._engine_clients == {}  # a retry opens a fresh client


def test_a_broken_gather_is_not_drained(monkeypatch):
    gathered = []

    def buckets():
        gathered.append(0)
        yield [("w0", None)]
        raise RuntimeError("gloo: connection closed by peer")

    rank = sending_rank(buckets(), FailingClient(fail_at=99), monkeypatch)
    with pytest.raises(RuntimeError, match="gloo"):
        RoleRuntime.push_weights_to_engine(rank, "cpu", "http://engine-1", 3, 1 << 20)
    assert gathered == [0]


class FailsOnceGroup:
    """A torchrun role group: the first push raises on every rank alike (`fails_together`)."""

    fails_together = True

    def __init__(self, failures=1, error=None):
        self.failures, self.pushes = failures, []
        self.error = error or WeightPushFailed("weight push to http://engine-1 failed (rank 0: ...)",
                                               transport_failure=True)

    def push_weights(self, kind, url, version, bucket_bytes, api_key, check=False):
        self.pushes.append((url, version))
        if self.failures:
            self.failures -= 1
            raise self.error
        return [1, 0]


class TorchrunRank:
    """A torchrun channel as one rank sees it: rank 0 drives; `share` hands over rank 0's value."""

    def __init__(self, is_driver: bool, driver_value=None):
        self.is_driver, self.driver_value = is_driver, driver_value

    def share(self, value):
        return value if self.is_driver else self.driver_value


def trainer_on(channel, group, rollout=None):
    trainer = object.__new__(StacxTrainer)
    trainer.channel, trainer.roles, trainer.rollout = channel, {"policy": group}, rollout
    return trainer


TARGET = EngineTarget("cpu", ("http://engine-1", "http://engine-2"), None)


def test_under_torchrun_the_driver_decides_and_every_rank_retries_the_push_on_the_recovered_engine():
    decided = []
    rollout = SimpleNamespace(recover_engine=lambda url, err: decided.append((url, err)) or "retry")
    driver = FailsOnceGroup()
    trainer_on(TorchrunRank(True), driver, rollout).push_weights_to("policy", TARGET, "http://engine-1", 4)
    assert driver.pushes == [("http://engine-1", 4)] * 2
    assert [url for url, _ in decided] == ["http://engine-1"] and is_transport_failure(decided[0][1])
    other = FailsOnceGroup()  # rank 1 has no rollout service: it follows rank 0's answer
    trainer_on(TorchrunRank(False, driver_value="retry"), other).push_weights_to("policy", TARGET, "http://engine-1", 4)
    assert other.pushes == [("http://engine-1", 4)] * 2


def test_under_torchrun_a_set_aside_engine_is_skipped_and_a_refused_push_raises_on_every_rank():
    skipped = FailsOnceGroup()
    trainer_on(TorchrunRank(False, driver_value="skip"), skipped).push_weights_to("policy", TARGET, "http://engine-1", 4)
    assert skipped.pushes == [("http://engine-1", 4)]
    for channel in (TorchrunRank(True), TorchrunRank(False, driver_value="raise")):
        refused = FailsOnceGroup(error=WeightPushFailed("refused", transport_failure=False))
        rollout = SimpleNamespace(recover_engine=lambda url, err: "raise")
        with pytest.raises(WeightPushFailed, match="refused"):
            trainer_on(channel, refused, rollout).push_weights_to("policy", TARGET, "http://engine-1", 4)


def test_a_group_whose_ranks_do_not_fail_together_is_never_retried_by_one_rank_alone():
    group = FailsOnceGroup()
    group.fails_together = False
    rollout = SimpleNamespace(recover_engine=lambda url, err: pytest.fail("asked to recover"))
    with pytest.raises(WeightPushFailed):
        trainer_on(TorchrunRank(True), group, rollout).push_weights_to("policy", TARGET, "http://engine-1", 4)


def test_the_outcomes_and_the_refresh_marker_travel_as_rank_messages():
    from stacx.trainer.cluster.rank_messages import decode_message, encode_message
    from stacx.trainer.loop import REFRESH_WEIGHTS

    failed = push_outcome(lambda: (_ for _ in ()).throw(unanswered()))
    for value in (failed, push_outcome(lambda: 3), (None, {REFRESH_WEIGHTS: 3.0})):
        assert decode_message(encode_message(value)) == value
