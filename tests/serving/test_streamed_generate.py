"""A streamed `/generate` keeps a dying engine's tokens (issue 44): `stacx serve`'s endpoint streams each request's
tokens as they are generated, the client keeps them, and when the server goes away mid-call a supervised pool
continues each request from its tokens on a live server, every token keeping its log-prob and weight version.

In-process: `EngineHttpServer` on loopback over a scripted engine that decodes like the CPU engine (its outputs on
the requests' abort flags) one token per permit the test gives. The test waits (bounded) until the client holds
the tokens it gave, then stops the server: which tokens exist when it goes away never depends on thread timing.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.sections import RolloutSection
from stacx.serving.server import EngineHttpServer
from stacx.wire.http_client import RetryPolicy, ServerUnavailableError
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams

TIMEOUT_S = 30
REQUESTS = [GenerateRequest(input_ids=(10, 11), sampling=SamplingParams(max_new_tokens=5), return_logprob=True,
                            rid="a"),
            GenerateRequest(input_ids=(20,), sampling=SamplingParams(max_new_tokens=5), return_logprob=True)]


class StepwiseEngine:
    """Generates one token per request for each permit (`allow`): at weight version v the token at position i of
    the sequence (prompt and tokens so far) is 100 * v + i, the call's j-th token's log-prob -(j + 1) / 10."""

    def __init__(self, version: int):
        self.version, self.permits = version, threading.Semaphore(0)

    def allow(self, steps: int) -> None:
        for _ in range(steps):
            self.permits.release()

    def generate(self, requests, *, should_stop=None, abort_flags=None):
        outputs = [GenerateOutput(output_ids=[], weight_version=self.version) for _ in requests]
        for flag, output in zip(abort_flags or (), outputs):
            flag.output = output
        for step in range(max(r.sampling.max_new_tokens for r in requests)):
            if not self.permits.acquire(timeout=TIMEOUT_S):
                raise RuntimeError("the test gave no permit for the next token")
            for request, output in zip(requests, outputs):
                if len(output.output_ids) < request.sampling.max_new_tokens:
                    output.output_ids.append(100 * self.version + len(request.input_ids) + len(output.output_ids))
                    output.output_token_versions.append(self.version)
                    output.output_log_probs.append(-len(output.output_ids) / 10)
        for output in outputs:
            output.finish_reason = "length"
        return outputs

    def weight_version(self):
        return self.version


def kill(server: EngineHttpServer) -> None:
    """Stop `server` as a killed process stops: its connections close at once (no graceful wait for the answers
    under way, which uvicorn otherwise gives 2 s)."""
    server._uvicorn.force_exit = True
    server.stop()


class Watched(HttpEngine):
    """The streaming client; `holds(n)` is set once it has received n tokens of every request."""

    def __init__(self, url: str, tokens: int, num_requests: int = len(REQUESTS)):
        super().__init__(url, RetryPolicy(timeout_s=TIMEOUT_S, max_attempts=1), stream_progress=True)
        self.holds, received, post_lines = threading.Event(), {}, self.transport.post_lines
        self.progress_lines = []

        def watched_lines(*args, **kwargs):
            for line in post_lines(*args, **kwargs):
                for piece in line.get("progress", ()):
                    received[piece["index"]] = piece["start"] + len(piece["output_ids"])
                    self.progress_lines.append(piece)
                if len(received) == num_requests and min(received.values()) >= tokens:
                    self.holds.set()
                yield line

        self.transport.post_lines = watched_lines


def test_a_streamed_answer_equals_the_unstreamed_one():
    engine = StepwiseEngine(version=3)
    with EngineHttpServer(engine) as server:
        engine.allow(10)
        streamed = HttpEngine(server.url, stream_progress=True).generate(REQUESTS)
        engine.allow(10)
        plain = HttpEngine(server.url).generate(REQUESTS)
    assert streamed == plain
    assert streamed[0].output_ids == [302, 303, 304, 305, 306] and streamed[0].output_token_versions == [3] * 5


def test_the_tokens_a_server_streamed_before_it_went_away_continue_on_a_live_server():
    dying, live = StepwiseEngine(version=3), StepwiseEngine(version=4)
    with EngineHttpServer(live) as other:
        server = EngineHttpServer(dying).start()
        watched = Watched(server.url, tokens=2)
        pool = EnginePool([watched, HttpEngine(other.url, stream_progress=True)], names=[server.url, other.url])
        # health checks every TIMEOUT_S: the broken stream, not a missed check, is what notices the server gone
        pool.supervise(settings=RolloutSection(engine_health_interval_s=TIMEOUT_S, attached_engine_wait_s=0.0))
        pool.in_flight[1] = 10  # the call goes to the server that goes away
        with ThreadPoolExecutor(1) as caller:
            call = caller.submit(pool._generate_on_least_loaded, list(REQUESTS))
            dying.allow(2)
            assert watched.holds.wait(TIMEOUT_S), "the client never received the first two tokens"
            live.allow(10)
            kill(server)  # its process is gone: the stream breaks off after two tokens of each request
            first, second = call.result(TIMEOUT_S)
        dying.allow(10)  # its engine thread ends
        pool.shutdown()
    # two tokens sampled at version 3 on the server that went away, the other three at version 4 on the live one
    assert first.output_ids == [302, 303, 404, 405, 406] and first.output_token_versions == [3, 3, 4, 4, 4]
    assert first.output_log_probs == pytest.approx([-0.1, -0.2, -0.1, -0.2, -0.3])
    assert second.output_ids == [301, 302, 403, 404, 405] and first.finish_reason == second.finish_reason == "length"
    assert pool.supervisor.metrics()["rollout/requests_reissued"] == 2.0
    assert pool.supervisor.metrics()["rollout/tokens_salvaged"] == 4.0


def test_a_broken_stream_raises_with_the_tokens_received():
    engine = StepwiseEngine(version=3)
    server = EngineHttpServer(engine).start()
    client = Watched(server.url, tokens=1)
    with ThreadPoolExecutor(1) as caller:
        call = caller.submit(client.generate, REQUESTS)
        engine.allow(1)
        assert client.holds.wait(TIMEOUT_S), "the client never received the first token"
        kill(server)
        with pytest.raises(ServerUnavailableError, match="the answer broke off") as broken:
            call.result(TIMEOUT_S)
    engine.allow(10)
    assert [o.output_ids for o in broken.value.partial] == [[302], [301]]
    assert [o.output_log_probs for o in broken.value.partial] == [[-0.1], [-0.1]]
    assert {o.finish_reason for o in broken.value.partial} == {"abort"}
    assert [o.output_token_versions for o in broken.value.partial] == [[3], [3]]


@pytest.mark.slow  # the CPU engine fixture costs ~14 s here; in test_cpu_engine_and_server.py it is built already
def test_the_cpu_engine_streams_its_tokens_as_it_decodes(cpu_engine, monkeypatch):
    held, release, calls, forward = threading.Event(), threading.Event(), [0], cpu_engine._model_call

    def model_call(*args):  # the 4th forward (prefill, then one a token) waits until the client holds 3 tokens
        calls[0] += 1
        if calls[0] == 4:
            held.set()
            assert release.wait(TIMEOUT_S), "the test never released the held forward"
        return forward(*args)

    monkeypatch.setattr(cpu_engine, "_model_call", model_call)
    request = GenerateRequest(input_ids=(4, 10, 11), return_logprob=True,
                              sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    with EngineHttpServer(cpu_engine) as server:
        client = Watched(server.url, tokens=3, num_requests=1)
        with ThreadPoolExecutor(1) as caller:
            call = caller.submit(client.generate, [request])
            assert client.holds.wait(TIMEOUT_S), "the client never received the first three tokens"
            release.set()
            streamed = call.result(TIMEOUT_S)
        plain = HttpEngine(server.url).generate([request])
    assert streamed == plain and len(streamed[0].output_ids) == 6
    received = [t for piece in client.progress_lines for t in piece["output_ids"]]
    assert received[:3] == streamed[0].output_ids[:3]  # streamed before the call ended, as the answer has them
    assert [lp for piece in client.progress_lines for lp in piece["output_log_probs"]][:3] == \
        pytest.approx(streamed[0].output_log_probs[:3])
