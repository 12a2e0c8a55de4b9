"""vLLM's streamed completions against the real server (the `vllm` tier; issue 44): the chunks `VllmEngine` reads
(streamed by default), joined, equal the unstreamed answer field by field, for greedy requests with top-k
log-probs and seeded sampled ones with token-id log-probs, and they arrive as several events (one per engine step),
which is what lets a killed server's tokens be kept (tests/serving/test_streamed_vllm_completions.py replays this
format, recorded from vLLM 0.32, against a server killed mid-answer)."""

from __future__ import annotations

import pytest

from stacx.rollout.engines.vllm import VllmEngine
from stacx.wire.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.vllm

REQUESTS = [
    GenerateRequest(input_ids=(3, 4, 5, 6, 7), sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
                    return_logprob=True, top_logprobs_num=2),
    GenerateRequest(input_ids=(8, 9, 10), sampling=SamplingParams(max_new_tokens=5, seed=7), return_logprob=True,
                    token_ids_logprob=(5, 9)),
    GenerateRequest(input_ids=(11, 12), sampling=SamplingParams(max_new_tokens=4, seed=3), return_logprob=True),
]


def fields(output) -> dict:
    return {name: getattr(output, name) for name in (
        "output_ids", "finish_reason", "output_token_versions", "weight_version")}


def assert_same_entries(streamed, whole, where: str) -> None:
    """The same (log-prob, token id) entries, log-probs to 1e-5; a token may stand in for another only where
    their log-probs tie (the engine's top-k breaks ties in no fixed order, and each call runs in its own batch)."""
    assert len(streamed) == len(whole), (where, streamed, whole)
    assert [lp for lp, _ in streamed] == pytest.approx([lp for lp, _ in whole], abs=1e-5), (where, streamed, whole)
    by_token = {token: lp for lp, token in whole}
    for lp, token in streamed:
        tied = [other for other_lp, other in whole if other != token and abs(other_lp - lp) <= 1e-5]
        assert token in by_token and by_token[token] == pytest.approx(lp, abs=1e-5) or tied, (where, streamed, whole)


def test_streamed_completions_joined_equal_the_unstreamed_answer(vllm_server):
    streamed, unstreamed = VllmEngine(vllm_server[0]), VllmEngine(vllm_server[0], stream_progress=False)
    events = []
    post_events = streamed.transport.post_events

    def counted(endpoint, body, **kwargs):
        for event in post_events(endpoint, body, **kwargs):
            events.append(event)
            yield event

    streamed.transport.post_events = counted
    try:
        # one request a call: each runs alone on the server both ways (a greedy row batched beside sampled ones can
        # report other top-k entries, e.g. -9999 for the runner-up: vLLM's answer differs, not the stream's)
        joined = [streamed.generate([request])[0] for request in REQUESTS]
        whole = [unstreamed.generate([request])[0] for request in REQUESTS]
        assert [fields(o) for o in joined] == [fields(o) for o in whole]
        for got, want in zip(joined, whole):
            assert got.output_log_probs == pytest.approx(want.output_log_probs, abs=1e-5)
            for name in ("output_top_log_probs", "output_token_ids_log_probs"):
                assert len(getattr(got, name)) == len(getattr(want, name))  # one entry a token, when asked
                for position, (entries, expected) in enumerate(zip(getattr(got, name), getattr(want, name))):
                    assert_same_entries(entries, expected, f"{name}[{position}]")
        assert joined[0].output_top_log_probs and joined[1].output_token_ids_log_probs
        with_tokens = [e for e in events if any(c.get("token_ids") for c in e.get("choices", ()))]
        assert len(with_tokens) > len(REQUESTS)  # the tokens came in several events per request, as generated
    finally:
        streamed.shutdown()
        unstreamed.shutdown()
