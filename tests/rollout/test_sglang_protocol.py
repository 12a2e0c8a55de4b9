"""The SGLang client's request building and response parsing, against recorded payload shapes."""

import json
import pathlib

import pytest
import torch

from stacx.rollout.engines.sglang_protocol import (
    build_generate_payload,
    parse_generate_payload,
    parse_generate_response,
    render_generate_item,
)
from stacx.rollout.teacher import TeacherClient
from stacx.rollout.types import GenerateRequest, SamplingParams

PAYLOADS = pathlib.Path(__file__).parent / "payloads"


def _load(name):
    return json.loads((PAYLOADS / name).read_text())


def _batch_requests():
    sampling = dict(temperature=0.8, top_p=0.95, top_k=20)
    return [
        GenerateRequest(input_ids=(151644, 872, 198), sampling=SamplingParams(max_new_tokens=3, **sampling)),
        GenerateRequest(input_ids=(151644, 77091), sampling=SamplingParams(max_new_tokens=4, **sampling),
                        logprob_start_len=0, top_logprobs_num=2),
    ]


def test_request_building_matches_recorded_payload():
    recorded = _load("sglang_generate_batch.json")
    assert build_generate_payload(_batch_requests()) == recorded["request"]


def test_response_parsing_of_recorded_payload():
    recorded = _load("sglang_generate_batch.json")
    first, second = parse_generate_response(recorded["response"], _batch_requests())
    assert first.output_ids == [21927, 0, 151645]
    assert first.output_log_probs == [-0.52, -1.25, -0.003]
    assert first.finish_reason == "stop" and first.weight_version == 7
    assert first.input_log_probs == []  # logprob_start_len -1: output tokens only
    assert second.finish_reason == "length"
    assert second.input_log_probs == [None, -3.75]
    assert second.input_top_log_probs == [None, [(-0.5, 872), (-3.75, 77091)]]
    assert second.output_top_log_probs[2] == [(-1.0, 13), (-2.5, 9707)]


def test_parsing_rejects_misaligned_answers():
    recorded = _load("sglang_generate_batch.json")
    broken = json.loads(json.dumps(recorded["response"]))
    broken[0]["meta_info"]["output_token_logprobs"][0][1] = 5
    with pytest.raises(ValueError, match="do not match output_ids"):
        parse_generate_response(broken, _batch_requests())
    with pytest.raises(ValueError, match="2 answers for 1 requests"):
        parse_generate_response(recorded["response"], _batch_requests()[:1])
    broken = json.loads(json.dumps(recorded["response"]))
    broken[1]["meta_info"]["input_token_logprobs"].pop()
    with pytest.raises(ValueError, match="expected 2"):
        parse_generate_response(broken, _batch_requests())


def test_server_side_round_trip():
    """The server reads what the client writes and answers what the client parses."""
    requests = _batch_requests()
    parsed, is_batch = parse_generate_payload(build_generate_payload(requests))
    assert is_batch and parsed == requests
    single, is_batch = parse_generate_payload({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
                                               "return_logprob": True, "token_ids_logprob": [4, 5]})
    assert not is_batch and single[0].token_ids_logprob == (4, 5) and single[0].sampling.max_new_tokens == 2
    recorded = _load("sglang_generate_batch.json")
    outputs = parse_generate_response(recorded["response"], requests)
    rendered = [render_generate_item(o, r, "x") for o, r in zip(outputs, requests)]
    assert parse_generate_response(rendered, requests) == outputs
    with pytest.raises(ValueError, match="unsupported keys"):
        parse_generate_payload({"input_ids": [1], "sampling_params": {"frequency_penalty": 1.0}})
    with pytest.raises(ValueError, match="'text' needs a server with a tokenizer"):
        parse_generate_payload({"text": "hi"})


def test_teacher_client_against_recorded_scoring_payload(monkeypatch):
    recorded = _load("sglang_teacher_scoring.json")
    client = TeacherClient("http://teacher.invalid:1", max_concurrency=1)
    sent = []

    def fake_post(endpoint, body, summary="", retry=None):
        sent.append((endpoint, body))
        return recorded["response"]

    monkeypatch.setattr(client.transports[0], "post_json", fake_post)
    ids = torch.tensor([[22, 7], [40, 22]])
    (scores,) = client.score([[5, 9, 14, 22, 31]], [2], top_k=2, ids_per_position=[ids])
    assert sent == [("/generate", recorded["request"])]
    assert scores.log_probs.tolist() == [-1.5, -0.25]
    assert scores.top_ids.tolist() == [[7, 22], [31, 40]]
    assert scores.top_log_probs.tolist() == [[-0.5, -1.5], [-0.25, -2.0]]
    assert scores.id_log_probs.tolist() == [[-1.5, -0.5], [-2.0, -5.0]]
