"""`--teacher-engine`: the kind of the `--teacher-url` server. The default ('http') sends `/generate` requests
(`stacx serve`, SGLang); 'vllm' scores through vLLM's client (prompt log-probs and top-k from `/v1/completions`),
and the preflight reads a vLLM teacher's tokenizer folder from `/v1/models`. Against fake servers (the answers
as vLLM 0.32 writes them); a live vLLM teacher: tests/vllm/test_vllm_top_log_probs.py."""

from __future__ import annotations

import pytest
import torch

from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.vllm import VllmEngine
from stacx.rollout.sections import TeacherSection
from stacx.rollout.service import build_teacher, teacher_engine_client
from stacx.rollout.teacher import TeacherUnavailableError
from stacx.trainer.recipes import get_recipe
from stacx.trainer.config.run import RunConfig
from stacx.trainer.preflight import PreflightError, check_services, check_teacher
from tests.json_routes import serve_json_routes

COMPLETION = {"choices": [{"token_ids": [9], "finish_reason": "length",
                           "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.7],
                                        "top_logprobs": [{"token_id:9": -0.7}]},
                           "prompt_logprobs": [None, {"6": {"logprob": -3.0}, "2": {"logprob": -0.1}},
                                               {"7": {"logprob": -0.2}, "1": {"logprob": -1.9}}]}]}


def test_the_default_teacher_speaks_generate_and_vllm_scores_through_its_client():
    default = build_teacher(TeacherSection(teacher_url="http://127.0.0.1:9"))
    assert default.engines == [] and len(default.transports) == 1
    vllm = build_teacher(TeacherSection(teacher_url="http://127.0.0.1:9", teacher_engine="vllm", teacher_retries=0))
    (engine,) = vllm.engines
    assert isinstance(engine, VllmEngine) and engine.url == "http://127.0.0.1:9" and vllm.transports == []
    # DAgger's teacher-executed turns go through the same kind's client
    assert isinstance(teacher_engine_client(TeacherSection(teacher_url="http://127.0.0.1:9")), HttpEngine)
    assert isinstance(teacher_engine_client(TeacherSection(teacher_url="http://127.0.0.1:9", teacher_engine="vllm")),
                      VllmEngine)
    default.close()
    vllm.close()


def test_a_vllm_teacher_scores_a_trajectory_over_http():
    server, url, posted = serve_json_routes({"/v1/models": (200, {"data": [{"id": "teacher", "root": "/models/t"}]})},
                                 {"/v1/completions": (200, COMPLETION)})
    teacher = build_teacher(TeacherSection(teacher_url=url, teacher_engine="vllm", teacher_retries=0))
    try:
        (scores,) = teacher.score([[5, 6, 7]], [2], top_k=2)
    finally:
        teacher.close()
        server.shutdown()
    (path, body), = [p for p in posted if p[0] == "/v1/completions"]
    assert body["model"] == "teacher" and body["prompt"] == [5, 6, 7] and body["prompt_logprobs"] == 2
    torch.testing.assert_close(scores.log_probs, torch.tensor([-3.0, -0.2]))
    assert scores.top_ids.tolist() == [[2, 6], [7, 1]]


def test_a_vllm_teacher_that_is_gone_fails_as_the_teacher():
    server, url, _ = serve_json_routes({}, {})
    server.shutdown()
    server.server_close()  # nothing listens there now
    teacher = build_teacher(TeacherSection(teacher_url=url, teacher_engine="vllm", teacher_retries=0,
                                           teacher_timeout_s=2.0))
    with pytest.raises((TeacherUnavailableError, RuntimeError), match="teacher|v1/models"):
        teacher.score([[5, 6, 7]], [2], top_k=2)
    teacher.close()


def test_an_unknown_teacher_engine_is_refused_before_start_naming_the_flag():
    run_config = RunConfig(teacher=TeacherSection(teacher_url="http://127.0.0.1:9", teacher_engine="vlm"))
    with pytest.raises(PreflightError, match=r"--teacher-engine 'vlm' is not a registered engine kind.*'vllm'"):
        check_services(run_config, get_recipe("opd"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from stacx.tasks import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("teacher_engine")
    return {"addition": write_tiny_checkpoint(str(root / "addition"), "addition"),
            "sorting": write_tiny_checkpoint(str(root / "sorting"), "sorting")}


def test_a_vllm_teacher_is_checked_by_the_tokenizer_folder_its_models_list_names(checkpoints):
    """vLLM has no /get_model_info; its /v1/models entry's `root` is the folder it serves."""
    for served, refused in ((checkpoints["sorting"], True), (checkpoints["addition"], False)):
        server, url, _ = serve_json_routes({"/health": (200, {}), "/v1/models": (200, {"data": [{"id": "t", "root": served}]})}, {})
        try:
            if refused:
                with pytest.raises(PreflightError, match=r"--teacher-url .*tokenizer .* differs from the student's"):
                    check_teacher(url, checkpoints["addition"])
            else:
                check_teacher(url, checkpoints["addition"])
        finally:
            server.shutdown()
