"""The SGLang client's request building and response parsing, against recorded payload shapes."""

import json
import pathlib

import pytest
import torch

from stacx.rollout.continuation import continuation_request, join_outputs
from stacx.rollout.teacher import TeacherClient
from stacx.wire.sglang_protocol import (
    build_abort_payload,
    build_generate_payload,
    parse_abort_payload,
    parse_generate_payload,
    parse_generate_response,
    render_generate_item,
)
from stacx.wire.types import GenerateRequest, SamplingParams

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


def _abort_requests():
    sampling = dict(max_new_tokens=8, temperature=0.8)
    return [GenerateRequest(input_ids=(151644, 872, 198), rid="rollout-0", sampling=SamplingParams(seed=11, **sampling)),
            GenerateRequest(input_ids=(151644, 77091), rid="rollout-1", sampling=SamplingParams(seed=12, **sampling))]


def test_abort_and_continuation_map_onto_sglangs_recorded_payloads():
    """rid on /generate, /abort_request's two shapes, an aborted answer (mid-decode and still queued),
    the continuation's input_ids and budget, and the joined output with a version per token."""
    recorded = _load("sglang_generate_abort.json")
    requests = _abort_requests()
    assert build_generate_payload(requests) == recorded["request"]
    assert build_abort_payload("rollout-0") == recorded["abort_one"]
    assert build_abort_payload(None) == recorded["abort_all"]
    assert parse_abort_payload(recorded["abort_one"]) == ["rollout-0"]
    assert parse_abort_payload(recorded["abort_all"]) is None

    partial, queued = parse_generate_response(recorded["response"], requests)
    assert partial.finish_reason == queued.finish_reason == "abort"
    assert partial.output_ids == [21927, 0, 13] and partial.output_log_probs == [-0.52, -1.25, -0.75]
    assert partial.output_token_versions == [7, 7, 7] and partial.weight_version == 7
    assert queued.output_ids == [] and queued.output_token_versions == []

    follow_up = continuation_request(requests[0], partial)
    assert build_generate_payload([follow_up]) == recorded["continuation_request"]
    (rest,) = parse_generate_response(recorded["continuation_response"], [follow_up])
    whole = join_outputs(partial, rest)
    assert whole.output_ids == [21927, 0, 13, 0, 151645] and whole.finish_reason == "stop"
    assert whole.output_log_probs == [-0.52, -1.25, -0.75, -0.31, -0.05]
    assert whole.output_token_versions == [7, 7, 7, 8, 8] and whole.weight_version == 7
    # stacx serve answers an aborted request in the same shape, and reads the same rid field
    rendered = render_generate_item(partial, requests[0], "rollout-0")
    assert rendered["meta_info"]["finish_reason"]["type"] == "abort" and rendered["meta_info"]["id"] == "rollout-0"
    assert parse_generate_response([rendered], requests[:1]) == [partial]
    parsed, _ = parse_generate_payload(recorded["request"])
    assert parsed == requests


def test_abort_payload_and_continuation_mistakes_name_the_field():
    with pytest.raises(ValueError, match="'rid' must be a non-empty string.*abort_all"):
        parse_abort_payload({})
    with pytest.raises(ValueError, match="'abort_all' must be true or false"):
        parse_abort_payload({"abort_all": "yes"})
    with pytest.raises(ValueError, match="'rid\\[1\\]' must be a non-empty string"):
        parse_generate_payload({"input_ids": [[1], [2]], "rid": ["a", 3]})
    with pytest.raises(ValueError, match="rid must be a non-empty string"):
        GenerateRequest(input_ids=(1,), rid="")
    recorded = _load("sglang_generate_abort.json")
    request = _abort_requests()[0]
    finished = parse_generate_response(recorded["continuation_response"], [request])[0]
    with pytest.raises(ValueError, match="finished with 'stop', not 'abort'"):
        continuation_request(request, finished)
    # a request without a rid in a batch that has some: SGLang takes all rids or none, so it gets one
    mixed = build_generate_payload([request, GenerateRequest(input_ids=(5,))])
    assert mixed["rid"][0] == "rollout-0" and isinstance(mixed["rid"][1], str) and mixed["rid"][1]


def test_routed_experts_requested_and_parsed_in_sglangs_format():
    recorded = _load("sglang_generate_routed_experts.json")
    request = GenerateRequest(input_ids=(11, 12, 13), return_routed_experts=True,
                              sampling=SamplingParams(max_new_tokens=2, temperature=1.0))
    assert build_generate_payload([request]) == recorded["request"]
    (output,) = parse_generate_response(recorded["response"], [request])
    assert output.routed_experts.dtype == torch.int32
    assert output.routed_experts.tolist() == torch.tensor(recorded["routes"]).view(4, 4).tolist()  # [tokens run, L*k]
    # a narrower wire dtype (newer SGLang's meta_info.routed_experts_dtype) decodes to the same ids
    import base64
    narrow = dict(recorded["response"][0]["meta_info"], routed_experts_dtype="uint8",
                  routed_experts=base64.b64encode(bytes(recorded["routes"])).decode())
    (again,) = parse_generate_response([dict(recorded["response"][0], meta_info=narrow)], [request])
    assert torch.equal(again.routed_experts, output.routed_experts)
    # a server started without --enable-return-routed-experts sends none: the error names the flag
    bare = {k: v for k, v in recorded["response"][0]["meta_info"].items() if k != "routed_experts"}
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        parse_generate_response([dict(recorded["response"][0], meta_info=bare)], [request])
    # `stacx serve` answers in the same shape, and reads the request flag
    (served,), _ = parse_generate_payload(recorded["request"])
    assert served.return_routed_experts
    output.routed_experts = output.routed_experts.view(4, 2, 2)
    rendered = render_generate_item(output, request, "r0")
    assert rendered["meta_info"]["routed_experts"] == recorded["response"][0]["meta_info"]["routed_experts"]
