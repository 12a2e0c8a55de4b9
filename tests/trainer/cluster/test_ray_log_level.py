"""Ray's own INFO lines stay out of a run's output: every `ray.init` of `connect_ray` asks for warnings
and up (worker output, which carries the run's own lines and errors, still reaches the driver)."""

from __future__ import annotations

import logging

from stacx.trainer.cluster.ray import connect as ray_cluster
from stacx.trainer.cluster.ray.connect import RAY_LOGGING_LEVEL, connect_ray
from tests.trainer.cluster.fake_ray import fake_local_ray


def _fake_ray(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    fake_local_ray(monkeypatch, lambda **kwargs: calls.append(kwargs))
    return calls


def test_a_local_start_and_an_attach_both_hide_rays_info_lines(monkeypatch):
    assert RAY_LOGGING_LEVEL == logging.WARNING
    calls = _fake_ray(monkeypatch)
    connect_ray(None, num_cpus=1, environ={})
    connect_ray("10.0.0.1:6379", environ={})
    assert [call["logging_level"] for call in calls] == [logging.WARNING, logging.WARNING]
    assert all(call["log_to_driver"] is True for call in calls)  # workers' own lines and errors still show
    assert ray_cluster.RAY_LOGGING_LEVEL > logging.INFO


def test_starting_a_local_cluster_is_announced_and_attaching_is_not(monkeypatch, capsys):
    _fake_ray(monkeypatch)
    connect_ray(None, num_cpus=2, environ={})
    assert "stacx: starting a local Ray cluster (2 CPUs" in capsys.readouterr().err
    connect_ray("10.0.0.1:6379", environ={})
    assert "starting" not in capsys.readouterr().err
