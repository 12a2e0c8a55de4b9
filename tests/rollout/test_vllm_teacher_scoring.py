"""vLLM as a distillation teacher (no server: its answers as vLLM 0.32 writes them): a prefill-only scoring request
(max_new_tokens=0, which vLLM refuses) is sent as one token the client drops, its prompt log-probs and top-k come
back per response position, and `TeacherClient` scores through engine clients instead of `/generate` URLs. Against
a live server: tests/vllm/test_vllm_top_log_probs.py."""

from __future__ import annotations

import pytest
import torch

from stacx.rollout.engines.vllm_protocol import build_completion_payload, parse_completion_response
from stacx.rollout.teacher import TeacherClient
from stacx.wire.types import GenerateRequest, SamplingParams

SCORING = SamplingParams(max_new_tokens=0, temperature=1.0)
ANSWER = {"choices": [{"token_ids": [9], "finish_reason": "length",
                       "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.7], "top_logprobs": [{"token_id:9": -0.7}]},
                       "prompt_logprobs": [None, {"6": {"logprob": -3.0}, "2": {"logprob": -0.1}},
                                           {"7": {"logprob": -0.2}, "1": {"logprob": -1.9}}]}]}


def test_a_scoring_request_asks_vllm_for_one_token_and_drops_it():
    request = GenerateRequest(input_ids=(5, 6, 7), sampling=SCORING, logprob_start_len=1, top_logprobs_num=2)
    payload = build_completion_payload(request, model="m")
    assert (payload["max_tokens"], payload["prompt_logprobs"], payload["logprobs"]) == (1, 2, 2)
    out = parse_completion_response(ANSWER, request, weight_version=2)
    assert out.output_ids == [] and out.output_log_probs == [] and out.output_token_versions == []
    assert out.finish_reason == "length"
    assert out.input_log_probs == [-3.0, -0.2]
    assert out.input_top_log_probs == [[(-0.1, 2), (-3.0, 6)], [(-0.2, 7), (-1.9, 1)]]


class ScoringEngine:
    """An engine client answering every request with ANSWER parsed (what a VllmEngine returns)."""

    def __init__(self):
        self.requests, self.closed = [], False

    def generate(self, requests):
        self.requests += requests
        return [parse_completion_response(ANSWER, request, weight_version=0) for request in requests]

    def shutdown(self):
        self.closed = True


def test_a_teacher_scores_through_engine_clients():
    engine = ScoringEngine()
    teacher = TeacherClient(engines=[engine])
    (scores,) = teacher.score([[5, 6, 7]], [2], top_k=2)
    with pytest.raises(ValueError, match="caller-chosen ids per position"):
        teacher.score([[5, 6, 7]], [2], ids_per_position=[torch.tensor([[1], [2]])])
    teacher.close()
    (request,) = engine.requests
    assert request.sampling.max_new_tokens == 0 and request.logprob_start_len == 1 and request.top_logprobs_num == 2
    torch.testing.assert_close(scores.log_probs, torch.tensor([-3.0, -0.2]))
    assert scores.top_ids.tolist() == [[2, 6], [7, 1]] and engine.closed
