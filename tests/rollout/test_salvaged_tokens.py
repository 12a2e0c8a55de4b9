"""Partial rollouts keep the tokens of an engine that stalled (issue 44): a call that misses its health checks is
aborted on that engine first; what it generated so far continues from its tokens on a live engine, joined token
by token with each token's version. An engine that answers nothing, or requests without rids, restart as before.
The tokens a dead engine streamed before its connection broke are continued the same way (the last section).
In-process fakes; the stalled call is released by the abort itself, never by a timer."""

from __future__ import annotations

import threading

from stacx.rollout.continuation import continuation_request, join_outputs
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.sections import RolloutSection
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import ServerUnavailableError
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams

class Engine(InferenceEngine):
    """The lifecycle calls a pool does not make here."""

    def update_weights(self, buckets, *, version):
        raise AssertionError("no weight update here")

    def weight_version(self):
        return 1

    def pause(self):
        pass

    def resume(self):
        pass

    def flush_cache(self):
        pass


FAST = RolloutSection(engine_health_interval_s=0.05, engine_deadline_s=30.0, attached_engine_wait_s=0.0)


class Stalling(Engine):
    """Generated two tokens (version 1) of each request, then stalls: its health check fails; `abort(rids)`
    returns the call with those tokens, finish 'abort' (unless `answers_abort` is False)."""

    def __init__(self, answers_abort: bool = True):
        self.answers_abort, self.aborted = answers_abort, threading.Event()
        self.abort_calls = []

    def generate(self, requests):
        self.aborted.wait(30)
        return [GenerateOutput(output_ids=[90, 91], output_log_probs=[-0.5, -0.6], finish_reason="abort",
                               output_token_versions=[1, 1], weight_version=1) for _ in requests]

    def abort(self, rids=None):
        self.abort_calls.append(list(rids or []))
        if not self.answers_abort:
            raise ConnectionError("no answer")
        self.aborted.set()

    def health(self):
        return False

    def shutdown(self):
        self.aborted.set()  # the stalled call ends when its client closes


class Live(Engine):
    """Three more tokens (version 1) for each request; records what it was asked."""

    def __init__(self):
        self.asked: list[GenerateRequest] = []

    def generate(self, requests):
        self.asked += list(requests)
        return [GenerateOutput(output_ids=[7, 8, 9][:r.sampling.max_new_tokens], output_log_probs=[-0.1, -0.2, -0.3],
                               finish_reason="stop", output_token_versions=[1, 1, 1], weight_version=1)
                for r in requests]

    def health(self):
        return True

    def shutdown(self):
        pass


def pool_of(stalled, live):
    pool = EnginePool([stalled, live], names=["http://a", "http://b"])
    pool.supervise(settings=FAST)
    pool.in_flight[1] = 1  # the first call goes to the stalling engine
    return pool


def request(rid):
    return GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=8, seed=5), rid=rid)


def test_a_stalled_engines_tokens_are_kept_and_the_request_continues_from_them_on_a_live_engine():
    stalled, live = Stalling(), Live()
    [output] = pool_of(stalled, live).generate([request("g0-s0")])
    assert stalled.abort_calls == [["g0-s0"]]
    assert output.output_ids == [90, 91, 7, 8, 9] and output.finish_reason == "stop"
    assert output.output_log_probs == [-0.5, -0.6, -0.1, -0.2, -0.3] and output.output_token_versions == [1] * 5
    [continued] = live.asked  # the continuation: prompt + the kept tokens, the budget left
    assert continued.input_ids == (1, 2, 3, 90, 91) and continued.sampling.max_new_tokens == 6


def test_an_engine_that_does_not_answer_the_abort_or_requests_without_rids_start_again():
    for stalled, rid in ((Stalling(answers_abort=False), "g0-s0"), (Stalling(), None)):
        live = Live()
        [output] = pool_of(stalled, live).generate([request(rid)])
        assert output.output_ids == [7, 8, 9] and live.asked[0].input_ids == (1, 2, 3)  # from its prompt
        assert stalled.abort_calls == ([["g0-s0"]] if rid else [])


# ---- an engine whose process died: the tokens it streamed before the connection broke --------------------------
# A transport failure that carries the outputs received before the connection broke (`partial`, as the streaming
# `/generate` client raises it) is continued on a live engine from those tokens, each token keeping the log-prob
# and weight version of the engine that sampled it; requests need no rid (a dead engine is asked to abort nothing).

TWO_REQUESTS = [GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=4), return_logprob=True),
            GenerateRequest(input_ids=(3,), sampling=SamplingParams(max_new_tokens=2), return_logprob=True)]


class DiesMidStream(Engine):
    """Its process died after streaming two tokens of the first request and all of the second."""

    def generate(self, requests):
        error = ServerUnavailableError("http://a", "/generate", "2 seqs", 1, "ConnectionError: connection reset")
        error.partial = [
            GenerateOutput(output_ids=[7, 8], output_log_probs=[-0.1, -0.2], output_token_versions=[3, 3],
                           weight_version=3, finish_reason="abort"),
            GenerateOutput(output_ids=[9, 9], output_log_probs=[-0.3, -0.4], output_token_versions=[3, 3],
                           weight_version=3, finish_reason="length")]
        raise error

    def health(self):
        return False


class LiveAtVersion4(Engine):
    def __init__(self):
        self.seen = []

    def generate(self, requests):
        self.seen.extend(requests)
        return [GenerateOutput(output_ids=[5] * r.sampling.max_new_tokens,
                               output_log_probs=[-0.5] * r.sampling.max_new_tokens,
                               output_token_versions=[4] * r.sampling.max_new_tokens, weight_version=4,
                               finish_reason="length") for r in requests]

    def health(self):
        return True


def test_tokens_received_before_an_engine_died_are_continued_on_a_live_engine_keeping_their_versions():
    live = LiveAtVersion4()
    pool = EnginePool([DiesMidStream(), live], names=["http://a", "http://b"])
    pool.supervise(settings=RolloutSection(engine_health_interval_s=0.05, attached_engine_wait_s=0.0))
    pool.in_flight[1] = 10  # the first call goes to the engine that dies
    first, second = pool._generate_on_least_loaded(list(TWO_REQUESTS))
    assert [r.input_ids for r in live.seen] == [(1, 2, 7, 8)]  # only the unfinished one continues, from its tokens
    assert live.seen[0].sampling.max_new_tokens == 2
    assert first.output_ids == [7, 8, 5, 5] and first.output_token_versions == [3, 3, 4, 4]
    assert first.output_log_probs == [-0.1, -0.2, -0.5, -0.5] and first.finish_reason == "length"
    assert second.output_ids == [9, 9] and second.output_token_versions == [3, 3]  # finished: kept as it came
    assert pool.supervisor.metrics()["rollout/requests_reissued"] == 2.0
    pool.shutdown()


def test_a_request_whose_engine_died_before_its_first_token_asks_its_prompt_log_probs_again():
    """A streamed request gets its prompt's log-probs with its first tokens: one whose engine died before any
    holds none, so its continuation asks them again and the joined output takes them from it."""
    asked = GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=4), logprob_start_len=1,
                            top_logprobs_num=1)
    nothing = GenerateOutput(output_ids=[], finish_reason="abort", weight_version=3)
    again = continuation_request(asked, nothing)
    assert again.logprob_start_len == 1 and again.input_ids == (1, 2, 3)
    answer = GenerateOutput(output_ids=[5], output_log_probs=[-0.5], output_token_versions=[4], weight_version=4,
                            input_log_probs=[-1.0, -2.0], input_top_log_probs=[[(-1.0, 2)], [(-2.0, 3)]])
    joined = join_outputs(nothing, answer)
    assert joined.input_log_probs == [-1.0, -2.0] and joined.input_top_log_probs == [[(-1.0, 2)], [(-2.0, 3)]]
    streamed = GenerateOutput(output_ids=[7], output_log_probs=[-0.1], output_token_versions=[3], weight_version=3,
                              finish_reason="abort", input_log_probs=[-1.5, -2.5])
    assert continuation_request(asked, streamed).logprob_start_len == -1  # streamed with its first token
    assert join_outputs(streamed, answer).input_log_probs == [-1.5, -2.5]
