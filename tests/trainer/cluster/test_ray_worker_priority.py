"""A local cluster `connect_ray` starts runs its workers (the role workers: the run's own work) at the
driver's priority; Ray's default would start them 15 nice levels lower, where a busy machine starves them.
The real cluster's workers are checked in tests/trainer/cluster/test_ray_cluster.py."""

from __future__ import annotations

from stacx.trainer.cluster.ray import connect as ray_cluster
from stacx.trainer.cluster.ray.connect import LOOPBACK_ADDRESS, WORKER_NICENESS_INCREMENT, connect_ray


def test_a_local_start_asks_ray_for_workers_at_the_drivers_priority_and_an_attach_leaves_the_cluster_alone(monkeypatch):
    import ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": LOOPBACK_ADDRESS}])

    class NoReaper:  # no cluster starts here, so no process to sweep it
        @classmethod
        def start(cls):
            return cls()

        def finish(self):
            pass

    monkeypatch.setattr(ray_cluster, "ClusterReaper", NoReaper)
    connect_ray(None, num_cpus=1, environ={})
    connect_ray("10.0.0.1:6379", environ={})
    assert WORKER_NICENESS_INCREMENT == 0
    assert calls[0]["_system_config"] == {"worker_niceness": 0}
    assert "_system_config" not in calls[1]  # an attached cluster keeps its own `ray start` settings
