"""vLLM's streamed completions keep a dying server's tokens (issue 44): `VllmEngine` (streamed by default) asks
`/v1/completions` with `"stream": true`, keeps each chunk's tokens and log-probs as they arrive, and when the answer
breaks off raises them as `partial`, which a supervised pool continues on a live engine (stacx.rollout.salvage).

Against a loopback fake that replays answers recorded from a real vLLM 0.32 CPU server (tests/wire/payloads/
vllm_completion_*.json: the request and its unstreamed answer; *.sse: the same request's streamed answer, byte for
byte), sending them in HTTP chunks as uvicorn does. A "killed" server sends the first events of a recorded answer
and drops the connection: what the client holds when it breaks never depends on timing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from http.server import BaseHTTPRequestHandler

import pytest

from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.vllm import VllmEngine
from stacx.rollout.engines.vllm_protocol import streams
from stacx.rollout.sections import RolloutSection
from stacx.wire.http_client import RetryPolicy, ServerRequestError, ServerUnavailableError
from stacx.wire.types import GenerateRequest, SamplingParams
from tests.json_routes import ReplayServer, answer_event_stream, answer_json

PAYLOADS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "wire", "payloads")
CASES = ("greedy_top2", "sampled_ids", "plain")
NO_RETRY = RetryPolicy(timeout_s=30, max_attempts=1)


def recorded(case: str) -> tuple[dict, dict, list[bytes]]:
    """(the request body vLLM was sent, its unstreamed answer, the events of its streamed answer)."""
    with open(os.path.join(PAYLOADS, f"vllm_completion_{case}.json")) as handle:
        record = json.load(handle)
    with open(os.path.join(PAYLOADS, f"vllm_completion_{case}.sse"), "rb") as handle:
        events = [event for event in handle.read().split(b"\n\n") if event.strip()]
    return record["request"], record["answer"], events


def request_of(body: dict) -> GenerateRequest:
    """The GenerateRequest whose `/v1/completions` body (vllm_protocol.build_completion_payload) `body` is."""
    logprobs = "logprobs" in body
    return GenerateRequest(
        input_ids=tuple(body["prompt"]), rid=body.get("request_id"), return_logprob=logprobs,
        top_logprobs_num=body.get("logprobs", 0) if logprobs and "logprob_token_ids" not in body else 0,
        token_ids_logprob=tuple(body.get("logprob_token_ids", ())),
        sampling=SamplingParams(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                                top_p=body["top_p"], top_k=body["top_k"], seed=body.get("seed"),
                                ignore_eos=body["ignore_eos"], stop_token_ids=tuple(body["stop_token_ids"])))


class Replay(BaseHTTPRequestHandler):
    """`/v1/models` and `/v1/completions` answered from `server.answer(body) -> (json or None, events, cut)`: the
    JSON answer when the request is not streamed, else the events, of which only the first `cut` are sent before
    the connection drops (None: all, then the end of the answer)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _json(self, status: int, body) -> None:
        answer_json(self, status, body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": "stacx-policy", "object": "model"}]})
        return self._json(200, {})  # /health

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        whole, events, cut = self.server.answer(body)
        if not body.get("stream"):
            return self._json(200, whole)
        answer_event_stream(self, list(events), cut)


class FakeVllm(ReplayServer):
    def __init__(self, answer):
        super().__init__(Replay, answer)


def replaying(cut: int | None = None):
    """An `answer` replaying the recorded case whose prompt the request has."""
    by_prompt = {tuple(recorded(case)[0]["prompt"]): recorded(case) for case in CASES}

    def answer(body):
        _, whole, events = by_prompt[tuple(body["prompt"])]
        return whole, events, cut

    return answer


def fields(output) -> dict:
    return {name: getattr(output, name) for name in (
        "output_ids", "output_log_probs", "finish_reason", "output_top_log_probs", "output_token_ids_log_probs",
        "output_token_versions", "weight_version")}


def test_streamed_completions_joined_equal_the_unstreamed_answer_for_each_recorded_request_kind():
    server = FakeVllm(replaying())
    requests = [request_of(recorded(case)[0]) for case in CASES]
    streamed, unstreamed = VllmEngine(server.url, stream_progress=True), VllmEngine(server.url, stream_progress=False)
    try:
        assert all(streams(r) for r in requests)
        joined = streamed.generate(requests)
        assert [body.get("stream") for body in server.bodies] == [True] * len(CASES)  # each one asked streamed
        sent = sorted(server.bodies, key=lambda body: body["prompt"])  # in flight at once: any order
        assert sent == sorted(({**recorded(case)[0], "stream": True} for case in CASES), key=lambda b: b["prompt"])
        whole = unstreamed.generate(requests)
        assert [fields(o) for o in joined] == [fields(o) for o in whole]
        assert all(o.output_ids and o.output_log_probs for o in joined)
        assert joined[0].output_top_log_probs and joined[1].output_token_ids_log_probs  # top-k, token-id log-probs
    finally:
        streamed.shutdown()
        unstreamed.shutdown()
        server.close()


def tokens_in(events: list[bytes]) -> list[int]:
    """The token ids the recorded events carry."""
    chunks = [json.loads(event[len(b"data:"):]) for event in events if event.strip() != b"data: [DONE]"]
    return [int(t) for chunk in chunks for choice in chunk.get("choices", []) for t in choice.get("token_ids") or []]


@pytest.mark.parametrize("cut", [1, 3])
def test_a_server_killed_mid_answer_raises_with_the_tokens_it_streamed_and_their_log_probs(cut):
    body, whole, events = recorded("greedy_top2")
    server = FakeVllm(replaying(cut))
    engine = VllmEngine(server.url, retry=NO_RETRY, stream_progress=True)
    request = request_of(body)
    try:
        with pytest.raises(ServerUnavailableError, match="the answer broke off") as broken:
            engine.generate([request])
        (kept,) = broken.value.partial
        full = VllmEngine(server.url, stream_progress=False).generate([request])[0]  # the unstreamed answer
        received = len(tokens_in(events[:cut]))
        assert 0 < received < len(full.output_ids) and kept.finish_reason == "abort"
        assert kept.output_ids == full.output_ids[:received] == tokens_in(events[:cut])
        assert kept.output_log_probs == full.output_log_probs[:received]
        assert kept.output_top_log_probs == full.output_top_log_probs[:received]
        assert kept.output_token_versions == [0] * received
    finally:
        engine.shutdown()
        server.close()


def continuing(version_tag: float):
    """An `answer` for any request: token 100 + position, log-prob `version_tag`, in chunks shaped like the
    recorded ones (a live engine continuing other engines' tokens)."""
    _, whole_template, events = recorded("plain")
    chunk_template = json.loads(events[0][len(b"data:"):])

    def answer(body):
        prompt, count = body["prompt"], body["max_tokens"]
        ids = [100 + len(prompt) + j for j in range(count)]
        logprobs = {"text_offset": list(range(count)), "token_logprobs": [version_tag] * count,
                    "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": [{f"token_id:{t}": version_tag}
                                                                               for t in ids]}
        choice = {**whole_template["choices"][0], "token_ids": ids, "logprobs": logprobs, "finish_reason": "length"}
        stream = []
        for j, token in enumerate(ids):
            piece = {key: value[j:j + 1] for key, value in logprobs.items()}
            stream.append({**chunk_template, "choices": [{**chunk_template["choices"][0], "token_ids": [token],
                                                          "logprobs": piece,
                                                          "finish_reason": "length" if j == count - 1 else None}]})
        events = [b"data: " + json.dumps(chunk).encode() for chunk in stream] + [b"data: [DONE]"]
        return {**whole_template, "choices": [choice]}, events, None

    return answer


def test_a_supervised_pool_continues_a_killed_vllm_servers_streamed_tokens_on_a_live_engine():
    body, whole, events = recorded("greedy_top2")
    dying, live = FakeVllm(replaying(cut=3)), FakeVllm(continuing(-0.25))
    engines = [VllmEngine(url, retry=NO_RETRY, stream_progress=True) for url in (dying.url, live.url)]
    pool = EnginePool(engines, names=[dying.url, live.url])
    pool.supervise(settings=RolloutSection(engine_health_interval_s=0.05, attached_engine_wait_s=0.0))
    request = request_of(body)
    try:
        (joined,) = pool.generate([request])
        kept = tokens_in(events[:3])
        # the live engine continued from the prompt and the kept tokens, for the budget left
        (continuation,) = live.bodies
        assert continuation["prompt"] == [*body["prompt"], *kept]
        assert continuation["max_tokens"] == body["max_tokens"] - len(kept)
        full = VllmEngine(dying.url, stream_progress=False).generate([request])[0]
        assert joined.output_ids[:len(kept)] == kept == full.output_ids[:len(kept)]
        assert joined.output_log_probs[:len(kept)] == full.output_log_probs[:len(kept)]  # the dead engine's
        assert joined.output_log_probs[len(kept):] == [-0.25] * (body["max_tokens"] - len(kept))  # the live one's
        assert len(joined.output_ids) == body["max_tokens"] and joined.finish_reason == "length"
        metrics = pool.supervisor.metrics()
        assert metrics["rollout/tokens_salvaged"] == len(kept) and metrics["rollout/requests_reissued"] == 1.0
    finally:
        pool.shutdown()
        dying.close()
        live.close()


def test_requests_whose_answer_no_chunk_carries_are_asked_unstreamed():
    """The prompt's log-probs, routed experts and a scoring request (no token generated) are never in a chunk."""
    body, whole, events = recorded("greedy_top2")
    prompt_logprobs = [None] + [{str(t): {"logprob": -1.0, "rank": 1, "decoded_token": "x"}} for t in body["prompt"][1:]]
    answer = {**whole, "choices": [{**whole["choices"][0], "prompt_logprobs": prompt_logprobs}]}
    server = FakeVllm(lambda _: (answer, events, None))
    engine = VllmEngine(server.url, stream_progress=True)
    prompt_asked = dataclasses.replace(request_of(body), logprob_start_len=0)
    routed = GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=4), return_routed_experts=True)
    scoring = GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=0), return_logprob=True)
    assert streams(request_of(body)) and not any(streams(r) for r in (prompt_asked, routed, scoring))
    try:
        (output,) = engine.generate([prompt_asked])
        assert "stream" not in server.bodies[0] and output.input_log_probs == [None] + [-1.0] * (len(body["prompt"]) - 1)
    finally:
        engine.shutdown()
        server.close()


def test_an_error_chunk_is_the_requests_fault_when_4xx_and_the_engines_failure_when_5xx():
    body, _, events = recorded("greedy_top2")

    def failing(status):
        error = {"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": status}}
        return lambda _: (None, [events[0], b"data: " + json.dumps(error).encode(), b"data: [DONE]"], None)

    for status, raised in ((400, ServerRequestError), (500, ServerUnavailableError)):
        server = FakeVllm(failing(status))
        engine = VllmEngine(server.url, retry=NO_RETRY, stream_progress=True)
        try:
            with pytest.raises(raised, match=f"HTTP {status}: boom") as failed:
                engine.generate([request_of(body)])
            if raised is ServerUnavailableError:  # the engine failed: what it streamed first is kept
                assert failed.value.partial[0].output_ids == tokens_in(events[:1])
        finally:
            engine.shutdown()
            server.close()
