"""A `connect_ray` without a cluster, for tests of what it asks Ray for: `ray.init` is the test's function,
the one node is on loopback, and no reaper process is started (there is no cluster to sweep)."""

from __future__ import annotations

from typing import Any, Callable

from stacx.trainer.cluster.ray import connect as ray_cluster
from stacx.trainer.cluster.ray.connect import LOOPBACK_ADDRESS


class NoReaper:
    """Stands in for `ClusterReaper`: no cluster starts here, so no process to sweep it."""

    @classmethod
    def start(cls):
        return cls()

    def finish(self):
        pass


def fake_local_ray(monkeypatch, init: Callable[..., Any]) -> None:
    """Make `connect_ray` start or attach through `init(**kwargs)` in place of `ray.init`."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": LOOPBACK_ADDRESS}])
    monkeypatch.setattr(ray_cluster, "ClusterReaper", NoReaper)
