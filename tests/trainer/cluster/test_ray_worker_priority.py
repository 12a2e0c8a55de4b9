"""A local cluster `connect_ray` starts runs its workers (the role workers: the run's own work) at the
driver's priority; Ray's default would start them 15 nice levels lower, where a busy machine starves them.
The real cluster's workers are checked in tests/trainer/cluster/test_ray_cluster.py."""

from __future__ import annotations

from stacx.trainer.cluster.ray.connect import WORKER_NICENESS_INCREMENT, connect_ray
from tests.trainer.cluster.fake_ray import fake_local_ray


def test_every_local_start_asks_ray_for_workers_at_the_drivers_priority_and_an_attach_leaves_the_cluster_alone(
        monkeypatch):
    calls: list[dict] = []

    def init(**kwargs):
        calls.append({**kwargs, "_system_config": dict(kwargs.get("_system_config", {}))} if "_system_config" in kwargs
                     else kwargs)
        if "_system_config" in kwargs:
            kwargs["_system_config"]["object_spilling_config"] = "{...}"  # Ray writes its defaults into it
        if len(calls) == 1:
            raise Exception("The current node timed out during startup.")  # retried once

    fake_local_ray(monkeypatch, init)

    connect_ray(None, num_cpus=1, environ={})
    connect_ray("10.0.0.1:6379", environ={})
    assert WORKER_NICENESS_INCREMENT == 0
    # Both attempts ask for the same thing: a retry never hands Ray back what it wrote into the first dict
    # (it would warn about an "unstable API" in the run's output).
    assert [call["_system_config"] for call in calls[:2]] == [{"worker_niceness": 0}, {"worker_niceness": 0}]
    assert "_system_config" not in calls[2]  # an attached cluster keeps its own `ray start` settings
