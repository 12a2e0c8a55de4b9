"""A local cluster `connect_ray` starts has its daemons poll less: they start with LEAN_DAEMON_ENV (and, for a
driver that takes no worker logs, QUIET_LOG_MONITOR_ENV) in their environment, a value the user set wins, and
the driver's environment is restored after the start (the run's other children do not get it)."""

from __future__ import annotations

import os

from stacx.trainer.cluster.ray.connect import LEAN_DAEMON_ENV, QUIET_LOG_MONITOR_ENV, connect_ray
from tests.trainer.cluster.fake_ray import fake_local_ray


def _fake_ray(monkeypatch, seen: list[dict]) -> None:
    fake_local_ray(monkeypatch, lambda **kwargs: seen.append(dict(os.environ)))


def test_a_local_clusters_daemons_start_with_metrics_off_and_slow_sweeps_and_the_driver_keeps_its_environment(
        monkeypatch):
    for name in {**LEAN_DAEMON_ENV, **QUIET_LOG_MONITOR_ENV}:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REPORTER_UPDATE_INTERVAL_MS", "7000")  # the user's own value
    seen: list[dict] = []
    _fake_ray(monkeypatch, seen)
    before = dict(os.environ)

    connect_ray(None, num_cpus=1, log_to_driver=False, environ={})
    connect_ray(None, num_cpus=1, environ={})  # a driver that takes worker logs

    quiet, logged = seen
    assert quiet["RAY_enable_metrics_collection"] == "0" and quiet["RAY_USAGE_STATS_ENABLED"] == "0"
    assert quiet["METRICS_RECORD_INTERVAL_S"] == "60" and quiet["REPORTER_UPDATE_INTERVAL_MS"] == "7000"
    assert all(quiet[name] == value for name, value in QUIET_LOG_MONITOR_ENV.items())
    assert logged["RAY_enable_metrics_collection"] == "0"
    assert not any(name in logged for name in QUIET_LOG_MONITOR_ENV)  # its workers' output is forwarded promptly
    assert dict(os.environ) == before
