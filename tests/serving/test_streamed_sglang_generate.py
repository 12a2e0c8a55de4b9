"""SGLang's streamed `/generate` keeps a dying server's tokens (issue 44): a run's `SglangEngine` asks `/generate`
with `"stream": true`, gathers each request's events (stacx.wire.sglang_stream), and when the answer breaks off
raises the tokens received, with their log-probs, as `partial`, which a supervised pool continues on a live
engine (stacx.rollout.salvage); a request SGLang refuses is the caller's mistake (4xx), an engine abort with a
5xx status the engine's failure, as unstreamed.

Against a loopback fake replaying tests/wire/payloads/sglang_generate_stream_batch.sse: the streamed answer of
sglang_generate_batch.json's request, written event by event as SGLang 0.5's HTTP server and tokenizer manager
write it (no GPU here to record one: `data: {...}` per event, one request's state each with its batch `index`,
output ids and every log-prob list cumulative, `finish_reason` null until its last event, then `data: [DONE]`),
sent in HTTP chunks. A "killed" server sends the first events and drops the connection: what the client holds
when it breaks never depends on timing.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from http.server import BaseHTTPRequestHandler

import pytest

from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.registry import engine_client
from stacx.rollout.engines.sglang import SglangEngine
from stacx.rollout.engines.streamed_generate import sglang_streams
from stacx.rollout.sections import RolloutSection
from stacx.wire.http_client import RetryPolicy, ServerRequestError, ServerUnavailableError
from stacx.wire.sglang_protocol import build_generate_payload
from stacx.wire.types import GenerateRequest, SamplingParams
from tests.json_routes import ReplayServer, answer_event_stream, answer_json

PAYLOADS = pathlib.Path(__file__).parents[1] / "wire" / "payloads"
NO_RETRY = RetryPolicy(timeout_s=30, max_attempts=1)
RECORD = json.loads((PAYLOADS / "sglang_generate_batch.json").read_text())
EVENTS = [json.loads(event[len(b"data:"):]) for event in (PAYLOADS / "sglang_generate_stream_batch.sse").read_bytes()
          .split(b"\n\n") if event.strip() and event.strip() != b"data: [DONE]"]


def batch_requests() -> list[GenerateRequest]:
    sampling = dict(temperature=0.8, top_p=0.95, top_k=20)
    return [GenerateRequest(input_ids=(151644, 872, 198), sampling=SamplingParams(max_new_tokens=3, **sampling)),
            GenerateRequest(input_ids=(151644, 77091), sampling=SamplingParams(max_new_tokens=4, **sampling),
                            logprob_start_len=0, top_logprobs_num=2)]


class Replay(BaseHTTPRequestHandler):
    """`/generate` answered from `server.answer(body) -> (json, events, cut)`: the JSON answer when the request is
    not streamed, else the events (dicts), of which only the first `cut` are sent before the connection drops
    (None: all, then `[DONE]`)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        answer_json(self, 200, {"weight_version": "7"})  # /health, /get_model_info

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        whole, events, cut = self.server.answer(body)
        if not body.get("stream"):
            return answer_json(self, 200, whole)
        frames = [b"data: " + (event.encode() if isinstance(event, str) else json.dumps(event).encode())
                  for event in [*events, "[DONE]"]]
        answer_event_stream(self, frames, cut)


class FakeSglang(ReplayServer):
    def __init__(self, answer):
        super().__init__(Replay, answer)


def replaying(events=EVENTS, cut: int | None = None):
    return lambda body: (RECORD["response"], events, cut)


def fields(output) -> dict:
    return {name: getattr(output, name) for name in (
        "output_ids", "output_log_probs", "finish_reason", "input_log_probs", "output_top_log_probs",
        "input_top_log_probs", "output_token_versions", "weight_version")}


def incremental(events: list[dict]) -> list[dict]:
    """The same answer from a server started with `--stream-output`: each event's output ids are its new ones."""
    seen: dict[int, int] = {}
    sliced = []
    for event in events:
        start = seen.get(event["index"], 0)
        sliced.append({**event, "output_ids": event["output_ids"][start:]})
        seen[event["index"]] = len(event["output_ids"])
    return sliced


@pytest.mark.parametrize("server_events", [EVENTS, incremental(EVENTS)], ids=["cumulative", "stream_output"])
def test_the_streamed_answer_gathered_equals_the_unstreamed_one(server_events):
    server = FakeSglang(replaying(server_events))
    streamed = engine_client("sglang", server.url)  # a run's client streams
    unstreamed = SglangEngine(server.url)
    requests = batch_requests()
    try:
        assert isinstance(streamed, SglangEngine) and streamed.stream_progress and not unstreamed.stream_progress
        joined = streamed.generate(requests)
        assert server.bodies[0] == {**RECORD["request"], "stream": True}  # the batched body, streamed
        whole = unstreamed.generate(requests)
        assert "stream" not in server.bodies[1] or server.bodies[1]["stream"] is False
        assert [fields(o) for o in joined] == [fields(o) for o in whole]
        assert joined[0].finish_reason == "stop" and joined[1].input_top_log_probs  # every log-prob field
    finally:
        streamed.shutdown()
        unstreamed.shutdown()
        server.close()


@pytest.mark.parametrize("cut", [1, 3, 5])
def test_a_server_killed_mid_answer_raises_with_each_requests_tokens_and_their_log_probs(cut):
    server = FakeSglang(replaying(cut=cut))
    engine = SglangEngine(server.url, retry=NO_RETRY, stream_progress=True)
    requests = batch_requests()
    try:
        with pytest.raises(ServerUnavailableError, match="the answer broke off|before its \\[DONE\\]") as broken:
            engine.generate(requests)
        whole = SglangEngine(server.url).generate(requests)
        kept = broken.value.partial
        assert len(kept) == 2
        for index, (output, full) in enumerate(zip(kept, whole)):
            received = max((len(e["output_ids"]) for e in EVENTS[:cut] if e["index"] == index), default=0)
            assert output.finish_reason == "abort" and output.output_ids == full.output_ids[:received]
            assert output.output_log_probs == full.output_log_probs[:received]
            assert output.output_token_versions == [7] * received
            if received and index == 1:  # the prompt's log-probs and the top-k come with the first event
                assert output.input_log_probs == full.input_log_probs
                assert output.output_top_log_probs == full.output_top_log_probs[:received]
        assert sum(len(o.output_ids) for o in kept) == cut  # one token an event
    finally:
        engine.shutdown()
        server.close()


def test_a_supervised_pool_continues_a_killed_sglang_servers_streamed_tokens_on_a_live_engine():
    request = batch_requests()[1]
    events = [e for e in EVENTS if e["index"] == 1]

    def continuing(body):  # any single request: tokens 100.., log-prob -0.25, at version 7, streamed
        (prompt,), (sampling,) = body["input_ids"], body["sampling_params"]
        count = sampling["max_new_tokens"]
        ids = [100 + j for j in range(count)]
        stream = [{"output_ids": ids[:j + 1], "meta_info": {
            "id": "live", "finish_reason": {"type": "length", "length": count} if j == count - 1 else None,
            "weight_version": "7", "completion_tokens": j + 1,
            "input_token_logprobs": [[None, prompt[0], None]] + [[-1.0, t, None] for t in prompt[1:]],
            "output_token_logprobs": [[-0.25, t, None] for t in ids[:j + 1]],
            "input_top_logprobs": [None] * len(prompt),
            "output_top_logprobs": [[[-0.25, t, None]] for t in ids[:j + 1]]}, "index": 0} for j in range(count)]
        return None, stream, None

    dying, live = FakeSglang(lambda body: (None, [dict(e, index=0) for e in events], 2)), FakeSglang(continuing)
    engines = [SglangEngine(url, retry=NO_RETRY, stream_progress=True) for url in (dying.url, live.url)]
    pool = EnginePool(engines, names=[dying.url, live.url])
    pool.supervise(settings=RolloutSection(engine_health_interval_s=0.05, attached_engine_wait_s=0.0))
    try:
        (joined,) = pool.generate([request])
        kept = events[1]["output_ids"]  # the two tokens the dead engine streamed
        (continuation,) = live.bodies  # continued from the prompt and the kept tokens, for the budget left
        assert continuation["input_ids"] == [[*request.input_ids, *kept]] and continuation["stream"] is True
        assert continuation["sampling_params"][0]["max_new_tokens"] == request.sampling.max_new_tokens - len(kept)
        assert joined.output_ids == [*kept, 100, 101] and joined.finish_reason == "length"
        dead_log_probs = [e[0] for e in events[1]["meta_info"]["output_token_logprobs"]]
        assert joined.output_log_probs == [*dead_log_probs, -0.25, -0.25]
        assert joined.input_log_probs == [None, -3.75]  # the prompt's, from the engine that saw the prompt
        metrics = pool.supervisor.metrics()
        assert metrics["rollout/tokens_salvaged"] == len(kept) and metrics["rollout/requests_reissued"] == 1.0
    finally:
        pool.shutdown()
        dying.close()
        live.close()


def test_an_error_event_or_a_400_abort_is_the_requests_fault_a_5xx_abort_the_engines_failure():
    first = EVENTS[0]

    def aborted(status):
        meta = {**first["meta_info"], "finish_reason": {"type": "abort", "message": "boom", "status_code": status}}
        return {**first, "meta_info": meta}

    cases = [({"error": {"message": "boom"}}, ServerRequestError, 400),  # SGLang's ValueError while streaming
             (aborted(400), ServerRequestError, 400), (aborted(503), ServerUnavailableError, 503),
             (aborted(500), ServerUnavailableError, 500)]
    for failure, raised, status in cases:
        server = FakeSglang(replaying([first, failure]))
        engine = SglangEngine(server.url, retry=NO_RETRY, stream_progress=True)
        try:
            with pytest.raises(raised, match=f"HTTP {status}: boom") as failed:
                engine.generate(batch_requests())
            if raised is ServerUnavailableError:  # the engine failed: what it streamed first is kept
                assert [o.output_ids for o in failed.value.partial] == [first["output_ids"], []]
        finally:
            engine.shutdown()
            server.close()


def test_an_ordinary_abort_ends_its_request_with_its_tokens_and_a_stream_without_every_finish_broke_off():
    """`/abort_request` (partial rollouts) finishes a request with type 'abort' and no status: its tokens are its
    answer. A stream that ends ([DONE]) while a request has not finished is an engine failure."""
    last = EVENTS[-1]
    stopped = {**last, "meta_info": {**last["meta_info"], "finish_reason": {"type": "abort", "message": "Abort"}}}
    finished_first = [e for e in EVENTS if e["index"] == 0]
    server = FakeSglang(replaying([*finished_first, stopped]))
    engine = SglangEngine(server.url, retry=NO_RETRY, stream_progress=True)
    try:
        first, second = engine.generate(batch_requests())
        assert first.finish_reason == "stop" and second.finish_reason == "abort"
        assert second.output_ids == last["output_ids"] and len(second.output_log_probs) == len(last["output_ids"])
        server.httpd.answer = replaying(finished_first)
        with pytest.raises(ServerUnavailableError, match=r"ended before requests \[1\] finished") as broken:
            engine.generate(batch_requests())
        assert broken.value.partial[0].output_ids == RECORD["response"][0]["output_ids"]
        assert broken.value.partial[1].output_ids == [] and broken.value.partial[1].finish_reason == "abort"
    finally:
        engine.shutdown()
        server.close()


def test_requests_no_event_can_carry_or_with_nothing_to_keep_are_asked_unstreamed():
    routed = dataclasses.replace(batch_requests()[0], return_routed_experts=True)
    scoring = GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=0), return_logprob=True,
                              logprob_start_len=0)
    assert sglang_streams(batch_requests()[0]) and not sglang_streams(routed) and not sglang_streams(scoring)
    server = FakeSglang(lambda body: ({"output_ids": [], "meta_info": {
        "finish_reason": {"type": "length", "length": 0}, "weight_version": "7",
        "input_token_logprobs": [[None, 1, None], [-0.5, 2, None]], "output_token_logprobs": []}}, [], None))
    engine = SglangEngine(server.url, retry=NO_RETRY, stream_progress=True)
    try:
        (output,) = engine.generate([scoring])
        assert server.bodies[0]["stream"] is False and output.input_log_probs == [None, -0.5]
        assert server.bodies[0] == build_generate_payload([scoring])
    finally:
        engine.shutdown()
        server.close()
