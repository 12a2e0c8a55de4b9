"""A single attached engine (`--rollout-urls`: the run cannot restart it) that fails is waited for, up to
`--attached-engine-wait-s`, and gets the current weights when it answers again (issue 44); in a pool of launched
and attached engines (a 'cpu' run given --rollout-urls) a failed launched engine is restarted and a failed attached
one set aside until it answers again (`rollout/engines_set_aside`, `rollout/engines_rejoined`).

Over HTTP on loopback: a fake `/generate` server in this process that goes away (its socket closed: connection
refused) and comes back on the same port serving weight version 0 (its owner restarted it), through the real
`HttpEngine` client and a supervised `EnginePool`. The server comes back when the pool's health probe asks for
the second time (the probing client brings it up first), so nothing depends on thread timing; the bound's test
waits for a server that never comes back.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stacx.rollout.engine_health import BEHIND, LIVE, OUT, EnginesBehind, EnginesLost, attach_supervisor
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.registry import EngineKind, add_engine_kind, resolve_engine_kind, unregister_engine
from stacx.rollout.plan import RolloutPlan
from stacx.rollout.sections import RolloutSection, TeacherSection
from stacx.rollout.service import RolloutService
from stacx.wire.http_client import RetryPolicy
from stacx.wire.types import GenerateRequest, SamplingParams

REQUESTS = [GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=2)),
            GenerateRequest(input_ids=(3, 4), sampling=SamplingParams(max_new_tokens=2))]
NO_RETRY = RetryPolicy(timeout_s=5, max_attempts=1)


class EchoHandler(BaseHTTPRequestHandler):
    """`/generate` echoes each prompt at the server's weight version; the lifecycle endpoints answer."""

    protocol_version = "HTTP/1.0"  # one request per connection: once it goes away, nothing answers

    def log_message(self, *args):
        pass

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/get_weight_version":
            return self._answer({"weight_version": self.server.version})
        return self._answer({"ok": True})  # /health

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path != "/generate":
            return self._answer({"ok": True})
        version = self.server.version
        return self._answer([{"output_ids": ids, "meta_info": {
            "weight_version": version, "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.5, token, None] for token in ids]}} for ids in payload["input_ids"]])


class FakeServer:
    """A `/generate` server on loopback that can go away and come back on the same port."""

    def __init__(self):
        self.port, self.httpd = 0, None
        self.start(version=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, version: int) -> None:
        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), EchoHandler)
        self.httpd.version = version
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def go_away(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def set_version(self, version: int) -> None:  # what the trainer's weight push does
        self.httpd.version = version


class ProbingClient(HttpEngine):
    """The real client; its `comes_back_at`-th health probe starts the server again first (its owner restarted it)."""

    def __init__(self, server: FakeServer, comes_back_at: int | None):
        super().__init__(server.url, NO_RETRY)
        self.server, self.comes_back_at, self.probes = server, comes_back_at, 0

    def health(self) -> bool:
        self.probes += 1
        if self.probes == self.comes_back_at:
            self.server.start(version=0)
        return super().health()


def attached_service(server: FakeServer, *, wait_s: float, comes_back_at: int | None):
    clients = []

    def connect(index):
        clients.append(ProbingClient(server, comes_back_at))
        return clients[-1]

    pool = EnginePool([HttpEngine(server.url, NO_RETRY)], names=[server.url])
    pool.supervise(settings=RolloutSection(engine_health_interval_s=0.05, attached_engine_wait_s=wait_s),
                   restart=None, connect=connect)
    return RolloutService(pool, engine_kind="http", url=server.url, tokenizer=None, rollout_section=None), clients


def push(service, server, version):
    """The trainer's push of `version` (StacxTrainer.push_policy_weights) to the engines it goes to."""
    service.begin_weight_update()
    assert service.weight_push_urls() == (server.url,)
    server.set_version(version)
    service.finish_weight_update(version)


def test_an_attached_engine_that_went_away_is_waited_for_and_given_the_current_weights_when_it_answers():
    server = FakeServer()
    service, clients = attached_service(server, wait_s=60.0, comes_back_at=2)
    try:
        push(service, server, 3)
        assert {o.weight_version for o in service.engine.generate(REQUESTS)} == {3}
        server.go_away()
        # the call fails, the pool waits, probing (through a fresh client: the failed one was closed) until the
        # server answers again: it serves version 0, behind the pool's 3, so the trainer must push first
        with pytest.raises(EnginesBehind, match=r"serves weight version 0, the pool 3") as behind:
            service.engine.generate(REQUESTS)
        assert behind.value.version == 3 and service.supervisor.states == [BEHIND]
        assert len(clients) == 1 and clients[0].probes == 2
        metrics = service.fault_metrics()  # the wait is counted, with its seconds (a probe interval at least)
        assert metrics["rollout/attached_engine_waits"] == 1.0 and metrics["rollout/attached_engine_wait_s"] >= 0.05
        push(service, server, 3)
        assert service.supervisor.states == [LIVE]
        outputs = service.engine.generate(REQUESTS)
        assert [o.output_ids for o in outputs] == [[1, 2], [3, 4]] and {o.weight_version for o in outputs} == {3}
        assert service.fault_metrics()["rollout/engine_restarts"] == 0.0  # the run restarted nothing
    finally:
        service.close()
        server.go_away()


def test_an_attached_engine_that_does_not_come_back_within_the_bound_stops_the_run_naming_its_url_and_the_flag():
    server = FakeServer()
    service, clients = attached_service(server, wait_s=0.3, comes_back_at=None)
    server.go_away()
    started = time.monotonic()
    with pytest.raises(EnginesLost, match=rf"{server.url} \(out: .*did not answer.*{server.url} did not pass its "
                                          r"health check within --attached-engine-wait-s 0.3 s.*raise "
                                          r"--attached-engine-wait-s") as lost:
        service.engine.generate(REQUESTS)
    assert not isinstance(lost.value, EnginesBehind) and service.supervisor.states == [OUT]
    assert time.monotonic() - started >= 0.3 and clients[0].probes >= 2  # it waited, probing, for the bound
    assert service.fault_metrics()["rollout/attached_engine_waits"] == 1.0
    assert service.fault_metrics()["rollout/attached_engine_wait_s"] >= 0.3
    service.close()


def test_the_run_flag_reaches_the_supervisor_and_zero_stops_at_once():
    assert RolloutSection().attached_engine_wait_s == 600.0
    with pytest.raises(ValueError, match="--attached-engine-wait-s must be >= 0"):
        RolloutSection(attached_engine_wait_s=-1.0)
    server = FakeServer()
    pool = EnginePool([HttpEngine(server.url, NO_RETRY)], names=[server.url])
    supervisor = attach_supervisor(pool, RolloutSection(attached_engine_wait_s=0.0), servers=None,
                                   connect=lambda url: ProbingClient(server, None))
    assert supervisor.settings.attached_engine_wait_s == 0.0 and supervisor.restart is None
    server.go_away()
    with pytest.raises(EnginesLost, match="--attached-engine-wait-s 0 s"):
        pool.generate(REQUESTS)
    assert isinstance(pool.engines[0], ProbingClient) and pool.engines[0].probes == 0  # a fresh client, no wait
    pool.shutdown()


def test_in_a_pool_of_launched_and_attached_engines_the_launched_one_is_restarted_the_attached_one_set_aside():
    launched, attached = FakeServer(), FakeServer()
    now, restarted = [0.0], []

    def restart(index):
        restarted.append(index)
        launched.start(version=0)
        return HttpEngine(launched.url, NO_RETRY)

    pool = EnginePool([HttpEngine(s.url, NO_RETRY) for s in (launched, attached)], names=[launched.url, attached.url])
    supervisor = pool.supervise(settings=RolloutSection(engine_health_interval_s=1.0, attached_engine_wait_s=60.0),
                                restart=restart, connect=lambda index: HttpEngine(pool.names[index], NO_RETRY),
                                clock=lambda: now[0], attached=[1])
    try:
        attached.go_away()  # the second chunk goes to it (fewest requests sent), fails, and goes to the launched one
        assert [o.output_ids for o in pool.generate(REQUESTS)] == [[1, 2], [3, 4]]
        assert supervisor.states == [LIVE, OUT] and restarted == []  # set aside: the run cannot restart it
        launched.go_away()
        attached.start(version=0)  # its owner restarted it
        now[0] += 1.0  # a health interval later its probe is due: it answers, at the pool's version 0
        assert [o.output_ids for o in pool.generate(REQUESTS)] == [[1, 2], [3, 4]]
        supervisor.wait_for_restarts()
        assert restarted == [0] and supervisor.states == [LIVE, LIVE]  # the launched one: restarted
        metrics = supervisor.metrics()
        assert [metrics[f"rollout/{key}"] for key in ("engine_restarts", "engines_set_aside", "engines_rejoined")] \
            == [1.0, 1.0, 1.0]
    finally:
        pool.shutdown()
        launched.go_away()
        attached.go_away()


def test_a_run_that_launches_its_servers_attaches_the_rollout_urls_beside_them_under_one_key(monkeypatch):
    assert resolve_engine_kind("cpu").attached_beside(["http://a"]) == ("http://a",)
    assert resolve_engine_kind("http").attached_beside(["http://a"]) == ()  # attached only: nothing launched
    launched, attached = FakeServer(), FakeServer()
    seen = {"restarted": []}

    class Servers:
        def wait_until_ready(self):
            return (launched.url,)

        def restart(self, index):
            seen["restarted"].append(index)
            return launched.url

        def stop(self):
            pass

    def launcher(launch):
        seen["key"] = launch.api_key
        return Servers()

    monkeypatch.setenv("STACX_API_KEY", "the-pool-key")
    add_engine_kind(EngineKind(name="fake_beside", launcher=launcher, attaches_beside_launched=True,
                               client=lambda url, *, api_key=None: HttpEngine(url, NO_RETRY, api_key=api_key)))
    plan = RolloutPlan(recipe="grpo", data_source="rollout")
    try:
        with pytest.raises(ValueError, match="--rollout-urls lists a server twice, or one the run launched"):
            RolloutService.start(RolloutSection(rollout_engine="fake_beside", rollout_urls=(launched.url,)),
                                 TeacherSection(), plan=plan, hf_checkpoint="tiny", tokenizer=object())
        service = RolloutService.start(RolloutSection(rollout_engine="fake_beside", rollout_urls=(attached.url,),
                                                      attached_engine_wait_s=0.0), TeacherSection(), plan=plan,
                                       hf_checkpoint="tiny", tokenizer=object())
    finally:
        unregister_engine("fake_beside")
    try:
        # one pool, one key: the launched servers take the driver's STACX_API_KEY, which the attached one takes
        assert service.urls == (launched.url, attached.url) and seen["key"] == service.api_key == "the-pool-key"
        assert service.supervisor.attached == {1}
        attached.go_away()
        assert [o.output_ids for o in service.engine.generate(REQUESTS)] == [[1, 2], [3, 4]]
        assert service.supervisor.states == [LIVE, OUT] and seen["restarted"] == []
        assert service.fault_metrics()["rollout/engines_set_aside"] == 1.0
    finally:
        service.close()
        launched.go_away()
