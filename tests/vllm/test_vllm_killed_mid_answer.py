"""A real vLLM server killed mid-answer (the `vllm` tier; issue 44): a streamed `/v1/completions` to a vLLM CPU
server whose process group is SIGKILLed as soon as the client has received the answer's first tokens. The client
raises with the tokens it received (`partial`), each with the log-prob the server gave it, and a supervised pool
continues them on a live engine (an in-process CPU engine on the same checkpoint): the continuation asks the
prompt and the kept tokens for the budget left, and the joined answer is the kept tokens then the live engine's.

The server is this file's own (killing the tier's shared one would break the other tests; it starts with the
session's other servers, tests/vllm/conftest.py). The kill happens in the
client's thread when the first event with tokens arrives, out of a greedy answer of 200 tokens (`ignore_eos`), so
the server is gone long before it could finish; the replayed-fake twin of this test, which decides where the
answer breaks byte for byte, is tests/serving/test_streamed_vllm_completions.py."""

from __future__ import annotations

import os
import signal

import pytest

from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.vllm import VllmEngine, VllmServerProcess
from stacx.rollout.sections import RolloutSection
from stacx.wire.http_client import RetryPolicy
from stacx.wire.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.vllm

REQUEST = GenerateRequest(input_ids=(3, 4, 5, 6, 7), return_logprob=True, top_logprobs_num=2,
                          sampling=SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True))
ONE_TRY = RetryPolicy(timeout_s=600, max_attempts=1)


@pytest.fixture
def private_vllm_server(killed_vllm_start):
    """A vLLM server of this test alone (it is killed), serving the tier's first checkpoint: started with the
    session's other servers (tests/vllm/conftest.py), ready here."""
    return killed_vllm_start.wait_until_ready(), killed_vllm_start


def killed_at_its_first_tokens(engine: VllmEngine, server: VllmServerProcess) -> list[dict]:
    """The engine's streamed answers SIGKILL the server's process group when the first event carrying tokens
    arrives, before the client keeps it; returns the events the client received."""
    received, post_events = [], engine.transport.post_events

    def killing(endpoint, body, **kwargs):
        for event in post_events(endpoint, body, **kwargs):
            if not received and any(choice.get("token_ids") for choice in event.get("choices", ())):
                os.killpg(server.process.pid, signal.SIGKILL)
            received.append(event)
            yield event

    engine.transport.post_events = killing
    return received


def test_a_vllm_server_killed_mid_answer_keeps_the_streamed_tokens_and_the_pool_continues_them(
        private_vllm_server, vllm_checkpoints):
    from stacx.serving.cpu_engine import CpuEngine

    url, server = private_vllm_server
    whole = VllmEngine(url, stream_progress=False)
    (unstreamed,) = whole.generate([REQUEST])  # the same greedy answer, whole, while the server lives
    whole.shutdown()
    assert len(unstreamed.output_ids) == REQUEST.sampling.max_new_tokens

    dying = VllmEngine(url, retry=ONE_TRY)  # streamed by default
    received = killed_at_its_first_tokens(dying, server)
    live = CpuEngine.from_hf_checkpoint(vllm_checkpoints[0])
    continued = []
    live_generate = live.generate
    live.generate = lambda requests: continued.extend(requests) or live_generate(requests)
    pool = EnginePool([dying, live], names=[url, "in-process"])  # the request goes to the vLLM server first
    pool.supervise(settings=RolloutSection(engine_health_interval_s=0.5, attached_engine_wait_s=0.0))
    try:
        (joined,) = pool.generate([REQUEST])
        assert server.process.wait(timeout=120) == -signal.SIGKILL  # it was killed (its exit may lag the kill)
        kept = [int(t) for event in received for choice in event.get("choices", ()) for t in choice.get("token_ids") or ()]
        assert 1 <= len(kept) < REQUEST.sampling.max_new_tokens, len(kept)
        assert kept == unstreamed.output_ids[:len(kept)]  # what the server streamed is its greedy answer's start
        # the live engine continued from the prompt and the kept tokens, for the budget left
        (continuation,) = continued
        assert continuation.input_ids == (*REQUEST.input_ids, *kept)
        assert continuation.sampling.max_new_tokens == REQUEST.sampling.max_new_tokens - len(kept)
        assert joined.output_ids[:len(kept)] == kept and len(joined.output_ids) == REQUEST.sampling.max_new_tokens
        assert joined.finish_reason == "length"
        # each kept token keeps the log-prob and top-2 the vLLM server gave it; the rest are the live engine's
        assert joined.output_log_probs[:len(kept)] == pytest.approx(unstreamed.output_log_probs[:len(kept)], abs=1e-5)
        assert len(joined.output_top_log_probs) == len(joined.output_ids)
        metrics = pool.supervisor.metrics()
        assert metrics["rollout/tokens_salvaged"] == float(len(kept))
        assert metrics["rollout/requests_reissued"] == 1.0 and metrics["rollout/live_engines"] == 1.0
        assert any("the answer" in reason or "Connection" in reason for _, reason in pool.supervisor.failures)
    finally:
        pool.shutdown()
