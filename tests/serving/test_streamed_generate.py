"""A streamed `/generate` keeps a dying engine's tokens (issue 44): `stacx serve`'s endpoint streams each request's
tokens as they are generated, the client keeps them, and when the server goes away mid-call a supervised pool
continues each request from its tokens on a live server, every token keeping its log-prob and weight version.

In-process: `EngineHttpServer` on loopback over a scripted engine that decodes like the CPU engine (its outputs on
the requests' abort flags) one token per permit the test gives. The test waits (bounded) until the client holds
the tokens it gave, then stops the server: which tokens exist when it goes away never depends on thread timing.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.registry import engine_client
from stacx.rollout.sections import RolloutSection
from stacx.serving.aborts import AbortFlag
from stacx.serving.server import EngineHttpServer
from stacx.wire.generate_progress import STREAM_CAPABILITY, extend_output
from stacx.wire.http_client import RetryPolicy, ServerRequestError, ServerUnavailableError
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams
from tests.json_routes import serve_json_routes

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
        flags = abort_flags or [AbortFlag(r.rid) for r in requests]
        outputs = [GenerateOutput(output_ids=[], weight_version=self.version) for _ in requests]
        routes = [[] for _ in requests]
        for flag, output, pieces in zip(flags, outputs, routes):
            flag.output, flag.routes = output, pieces
        for request, output, pieces in zip(requests, outputs, routes):  # the prefill, as the CPU engine fills it
            if request.return_logprob and request.logprob_start_len >= 0:
                for position in range(request.logprob_start_len, len(request.input_ids)):
                    output.input_log_probs.append(None if position == 0 else self.prompt_log_prob(position))
                    output.input_top_log_probs.append(None if position == 0 else self.top(request, position))
                    output.input_token_ids_log_probs.append(None if position == 0 else self.by_id(request, position))
            if request.return_routed_experts:
                pieces.append(self.routes(range(len(request.input_ids))))
        for step in range(max(r.sampling.max_new_tokens for r in requests)):
            if not self.permits.acquire(timeout=TIMEOUT_S):
                raise RuntimeError("the test gave no permit for the next token")
            for request, output, pieces in zip(requests, outputs, routes):
                if len(output.output_ids) < request.sampling.max_new_tokens:
                    self.record_token(request, output, pieces)
        for request, output, pieces in zip(requests, outputs, routes):
            output.finish_reason = "length"
            if request.return_routed_experts:  # the last token never ran through the model
                output.routed_experts = torch.cat(pieces)[:len(request.input_ids) + len(output.output_ids) - 1]
        return outputs

    def record_token(self, request, output, pieces) -> None:
        """The CPU engine's order: the token's id, then its log-prob fields; its route row once it ran."""
        position = len(request.input_ids) + len(output.output_ids)
        output.output_ids.append(100 * self.version + position)
        output.output_token_versions.append(self.version)
        if request.return_logprob:
            output.output_log_probs.append(-len(output.output_ids) / 10)
            if request.top_logprobs_num:
                output.output_top_log_probs.append(self.top(request, position))
            if request.token_ids_logprob:
                output.output_token_ids_log_probs.append(self.by_id(request, position))
        if request.return_routed_experts and len(output.output_ids) < request.sampling.max_new_tokens:
            pieces.append(self.routes([position]))

    def prompt_log_prob(self, position: int) -> float:
        return -(position + self.version) / 7

    def top(self, request, position: int) -> list:
        return [(-(position + self.version + k) / 3, 50 + k) for k in range(request.top_logprobs_num)]

    def by_id(self, request, position: int) -> list:
        return [(-(position * token + self.version) / 11, token) for token in request.token_ids_logprob]

    def routes(self, positions) -> torch.Tensor:
        """[tokens, 2 MoE layers, top 2] experts: the version, the position, and those plus one."""
        return torch.tensor([[[self.version, p], [self.version + 1, p + 1]] for p in positions], dtype=torch.int64)

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


EVERY_KIND = [  # every field an answer can carry, and a request with none of them
    GenerateRequest(input_ids=(10, 11, 12), sampling=SamplingParams(max_new_tokens=5), return_logprob=True,
                    logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=(3, 4), return_routed_experts=True,
                    rid="every"),
    GenerateRequest(input_ids=(20, 21), sampling=SamplingParams(max_new_tokens=4), return_logprob=True,
                    logprob_start_len=1, top_logprobs_num=1, rid="prompt-from-1"),
    GenerateRequest(input_ids=(30,), sampling=SamplingParams(max_new_tokens=3), return_logprob=True,
                    token_ids_logprob=(7,), return_routed_experts=True, rid="one-token-prompt"),
    GenerateRequest(input_ids=(40, 41), sampling=SamplingParams(max_new_tokens=3), return_logprob=False,
                    rid="no-log-probs"),
]
FIELDS = ("output_ids", "output_log_probs", "input_log_probs", "input_top_log_probs", "output_top_log_probs",
          "input_token_ids_log_probs", "output_token_ids_log_probs", "output_token_versions", "weight_version")


def assert_same_fields(joined: GenerateOutput, answer: GenerateOutput) -> None:
    for name in FIELDS:
        assert getattr(joined, name) == getattr(answer, name), name
    if answer.routed_experts is None:
        assert joined.routed_experts is None
    else:
        assert torch.equal(joined.routed_experts, answer.routed_experts)


def test_the_pieces_of_every_request_kind_join_to_the_unstreamed_answer_field_by_field():
    """Top-k, token-id and prompt log-probs and routed experts are streamed with their tokens (the prompt's once):
    the pieces received, joined, are the answer but its finish reason. Two tokens first, the rest after the client
    holds them: at least two pieces a request, the first with the prompt's fields."""
    engine = StepwiseEngine(version=3)
    with EngineHttpServer(engine) as server:
        client = Watched(server.url, tokens=2, num_requests=len(EVERY_KIND))
        with ThreadPoolExecutor(1) as caller:
            call = caller.submit(client.generate, EVERY_KIND)
            engine.allow(2)
            assert client.holds.wait(TIMEOUT_S), "the client never received the first two tokens"
            engine.allow(10)
            streamed = call.result(TIMEOUT_S)
        engine.allow(10)
        plain = HttpEngine(server.url).generate(EVERY_KIND)
    assert streamed == [dataclasses.replace(o, routed_experts=streamed[i].routed_experts) for i, o in enumerate(plain)]
    joined = [GenerateOutput(output_ids=[], finish_reason="abort") for _ in EVERY_KIND]
    for piece in client.progress_lines:
        extend_output(joined[piece["index"]], EVERY_KIND[piece["index"]], piece)
        assert ("input_log_probs" in piece) == (piece["start"] == 0 and EVERY_KIND[piece["index"]].logprob_start_len >= 0)
    for request, whole, answer in zip(EVERY_KIND, joined, plain):
        assert_same_fields(whole, answer)
        assert len(whole.output_ids) == request.sampling.max_new_tokens and whole.finish_reason == "abort"
    assert {piece["index"] for piece in client.progress_lines if piece["start"] >= 2} == set(range(len(EVERY_KIND)))
    assert plain[0].routed_experts.shape == (3 + 5 - 1, 4) and plain[0].input_top_log_probs[0] is None


def test_a_salvaged_request_keeps_the_prompt_and_top_k_fields_its_dead_server_streamed():
    """Two tokens of each request at version 3 on a server that goes away, the rest at version 4: the prompt's
    log-probs are the dead server's (streamed once, not asked again), each token's top-k and token-id log-probs
    its own server's, the routes the live server's (it ran the whole sequence again)."""
    dying, live = StepwiseEngine(version=3), StepwiseEngine(version=4)
    requests = EVERY_KIND[:3]
    with EngineHttpServer(live) as other:
        server = EngineHttpServer(dying).start()
        watched = Watched(server.url, tokens=2, num_requests=len(requests))
        pool = EnginePool([watched, HttpEngine(other.url, stream_progress=True)], names=[server.url, other.url])
        pool.supervise(settings=RolloutSection(engine_health_interval_s=TIMEOUT_S, attached_engine_wait_s=0.0))
        pool.in_flight[1] = 10  # the call goes to the server that goes away
        with ThreadPoolExecutor(1) as caller:
            call = caller.submit(pool._generate_on_least_loaded, list(requests))
            dying.allow(2)
            assert watched.holds.wait(TIMEOUT_S), "the client never received the first two tokens"
            live.allow(10)
            kill(server)
            outputs = call.result(TIMEOUT_S)
        dying.allow(10)
        pool.shutdown()
    every = outputs[0]
    assert every.output_ids == [303, 304, 405, 406, 407] and every.output_token_versions == [3, 3, 4, 4, 4]
    assert every.input_log_probs == [None, dying.prompt_log_prob(1), dying.prompt_log_prob(2)]
    assert every.input_top_log_probs == [None, dying.top(requests[0], 1), dying.top(requests[0], 2)]
    assert every.output_top_log_probs == [dying.top(requests[0], 3), dying.top(requests[0], 4),
                                          live.top(requests[0], 5), live.top(requests[0], 6), live.top(requests[0], 7)]
    assert every.output_token_ids_log_probs[:2] == [dying.by_id(requests[0], 3), dying.by_id(requests[0], 4)]
    assert torch.equal(every.routed_experts, live.routes(range(3 + 5 - 1)).view(7, 4).to(torch.int32))
    assert outputs[1].input_log_probs == [dying.prompt_log_prob(1)] and len(outputs[1].output_top_log_probs) == 4
    assert outputs[2].output_ids == [301, 302, 403] and outputs[2].routed_experts.shape == (1 + 3 - 1, 4)
    assert pool.supervisor.metrics()["rollout/tokens_salvaged"] == 6.0


SGLANG_ANSWER = {"text": "", "output_ids": [7, 8], "meta_info": {
    "finish_reason": {"type": "length", "length": 2}, "weight_version": "2",
    "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}}


def test_an_attached_server_is_streamed_when_its_model_info_offers_it_and_asked_plainly_otherwise():
    """The `http` kind (`--rollout-urls`) streams from `stacx serve`, which says so in /get_model_info, and asks
    SGLang (no such key) or a server without the endpoint unstreamed, as before."""
    request = [GenerateRequest(input_ids=(10,), sampling=SamplingParams(max_new_tokens=2), rid="r")]
    engine = StepwiseEngine(version=3)
    with EngineHttpServer(engine) as server:
        client = engine_client("http", server.url)
        lines, post_lines = [], client.transport.post_lines
        client.transport.post_lines = lambda *args, **kwargs: (lines.append(args[0]), post_lines(*args, **kwargs))[1]
        engine.allow(2)
        [streamed] = client.generate(request)
        assert lines == ["/generate"] and client.stream_progress is True
        assert streamed.output_ids == [301, 302] and client.model_info()[STREAM_CAPABILITY] is True
    for model_info in ({"/get_model_info": (200, {"model_path": "org/model", "weight_version": "2"})}, {}):
        fake, url, posted = serve_json_routes(model_info, {"/generate": (200, SGLANG_ANSWER)})
        try:
            [plain] = engine_client("http", url).generate(request)
        finally:
            fake.shutdown()
        assert plain.output_ids == [7, 8] and plain.output_log_probs == [-0.5, -0.25]
        assert [path for path, _ in posted] == ["/generate"] and posted[0][1]["stream"] is False


class Refusing(StepwiseEngine):
    """Refuses a request as the CPU engine refuses one past its context length: a ValueError naming the field."""

    def generate(self, requests, *, should_stop=None, abort_flags=None):
        raise ValueError("request 0: input_ids + sampling_params.max_new_tokens exceeds the model's context length")


def test_a_request_the_engine_refuses_is_a_rejection_streamed_or_not_never_a_failed_engine():
    """The streamed answer's status line is sent before the engine runs: its error line carries the status the
    unstreamed call answers (400), and the client raises the same `ServerRequestError`, which a supervised pool
    does not count against the engine."""
    with EngineHttpServer(Refusing(version=3)) as server:
        for client in (HttpEngine(server.url, stream_progress=True), HttpEngine(server.url)):
            with pytest.raises(ServerRequestError, match="exceeds the model's context length") as refused:
                client.generate(REQUESTS)
            assert refused.value.status_code == 400
