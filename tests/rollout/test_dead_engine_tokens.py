"""The seam for a dead engine's tokens (issue 44): a transport failure that carries the outputs received before
the connection broke (`partial`, as a streaming `/generate` client would raise it) is continued on a live engine
from those tokens, each token keeping the log-prob and weight version of the engine that sampled it; requests need
no rid (a dead engine is not asked to abort anything). In-process fakes, no server."""

from __future__ import annotations

from stacx.rollout.engine_health import EngineFaultSettings
from stacx.rollout.engine_pool import EnginePool
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import ServerUnavailableError
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams

REQUESTS = [GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=4), return_logprob=True),
            GenerateRequest(input_ids=(3,), sampling=SamplingParams(max_new_tokens=2), return_logprob=True)]


class Engine(InferenceEngine):
    def update_weights(self, buckets, *, version):
        pass

    def weight_version(self):
        return 0

    def pause(self):
        pass

    def resume(self):
        pass

    def flush_cache(self):
        pass


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


class Live(Engine):
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
    live = Live()
    pool = EnginePool([DiesMidStream(), live], names=["http://a", "http://b"])
    pool.supervise(settings=EngineFaultSettings(health_interval_s=0.05))
    pool.in_flight[1] = 10  # the first call goes to the engine that dies
    first, second = pool._generate_on_least_loaded(list(REQUESTS))
    assert [r.input_ids for r in live.seen] == [(1, 2, 7, 8)]  # only the unfinished one continues, from its tokens
    assert live.seen[0].sampling.max_new_tokens == 2
    assert first.output_ids == [7, 8, 5, 5] and first.output_token_versions == [3, 3, 4, 4]
    assert first.output_log_probs == [-0.1, -0.2, -0.5, -0.5] and first.finish_reason == "length"
    assert second.output_ids == [9, 9] and second.output_token_versions == [3, 3]  # finished: kept as it came
    assert pool.supervisor.metrics()["rollout/requests_reissued"] == 2.0
    pool.shutdown()
