"""SGLang servers a run launched are restarted like the CPU ones (issue 44): the dead or hung actor is killed and
the same server started again pinned to its node, on its address and port, so the run's clients and weight
pushes reach it at the same URL; the supervisor then treats the kind as restartable. Protocol level, with a fake
Ray (no GPU, no SGLang)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from stacx.rollout.engine_health import attach_supervisor
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines import sglang as sglang_engine
from stacx.rollout.engines.launchers import LaunchedSglangServers
from stacx.rollout.engines.sglang import SglangServerSpec
from stacx.rollout.sections import RolloutSection

URL = "http://10.0.0.7:30000"
SPEC = SglangServerSpec(model_path="policy", port=30000, api_key="secret")


def test_a_restart_kills_the_actor_and_starts_the_same_server_on_its_node_address_and_port(monkeypatch):
    killed, launched = [], []
    monkeypatch.setattr(ray, "kill", lambda actor: killed.append(actor))

    def launch(specs, *, pin_to_host):
        launched.append((specs, pin_to_host))
        return ["new actor"], [f"http://{specs[0].host}:{specs[0].port}"]

    servers = LaunchedSglangServers(["old actor"], (URL,), [SPEC], launch_on_ray=launch)
    assert servers.restart(0) == URL
    assert killed == ["old actor"] and servers.actors == ["new actor"]
    [([spec], pinned)] = launched
    assert pinned and spec.host == "10.0.0.7" and spec.port == 30000 and spec.api_key == "secret"
    assert spec.model_path == "policy"


def test_a_server_that_comes_back_elsewhere_or_was_never_specified_is_not_restarted(monkeypatch):
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    moved = LaunchedSglangServers(["old"], (URL,), [SPEC], launch_on_ray=lambda specs, pin_to_host: (["new"], ["http://10.0.0.8:30000"]))
    with pytest.raises(RuntimeError, match="came back at http://10.0.0.8:30000"):
        moved.restart(0)
    with pytest.raises(RuntimeError, match="without a spec"):
        LaunchedSglangServers(["old"], (URL,)).restart(0)


def test_pinning_places_the_actor_on_its_hosts_node(monkeypatch):
    placed = []

    class FakeActorClass:
        def options(self, **options):
            placed.append(options)
            return SimpleNamespace(remote=lambda spec, startup_timeout_s: SimpleNamespace(
                __ray_call__=SimpleNamespace(remote=lambda fn: "url")))

    monkeypatch.setattr(ray, "remote", lambda cls: FakeActorClass())
    monkeypatch.setattr(ray, "get", lambda refs, timeout: ["http://10.0.0.7:30000"])
    pinned = SglangServerSpec(model_path="policy", port=30000, host="10.0.0.7")
    sglang_engine.launch_sglang_servers_on_ray([pinned], pin_to_host=True)
    sglang_engine.launch_sglang_servers_on_ray([pinned])
    assert placed == [{"num_gpus": 1, "resources": {"node:10.0.0.7": 0.001}}, {"num_gpus": 1}]


def test_the_pool_of_a_launched_sglang_server_restarts_it():
    servers = LaunchedSglangServers(["actor"], (URL,), [SPEC], launch_on_ray=lambda specs, pin_to_host: None)
    pool = EnginePool([SimpleNamespace(url=URL)], names=[URL])
    supervisor = attach_supervisor(pool, RolloutSection(), servers=servers, connect=lambda url: url)
    assert supervisor.restart is not None
