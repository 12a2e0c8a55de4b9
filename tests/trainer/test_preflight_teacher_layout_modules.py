"""Preflight checks added for a newcomer's first run: the teacher server answers and shares the
student's vocabulary, TP/CP divide the attention heads, --custom-module imports. Each failure is
one PreflightError naming the flag and the fix."""

from __future__ import annotations

import pytest

from stacx.trainer.preflight import (PreflightError, check_custom_modules, check_parallel_layout, check_teacher)
from stacx.trainer.config.run import RunConfig
from tests.json_routes import serve_json_routes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from stacx.tasks import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("preflight")
    return {"addition": write_tiny_checkpoint(str(root / "addition"), "addition", num_attention_heads=4),
            "addition_copy": write_tiny_checkpoint(str(root / "addition_copy"), "addition", seed=1),
            "sorting": write_tiny_checkpoint(str(root / "sorting"), "sorting")}


def _serve(routes: dict[str, tuple[int, object]]):
    """A thread serving GET `routes` (path -> (status, JSON body)); returns (server, base URL)."""
    server, url, _ = serve_json_routes(routes)
    return server, url


def test_a_teacher_with_the_students_tokenizer_passes(checkpoints):
    server, url = _serve({"/health": (200, {}), "/get_model_info": (200, {"model_path": checkpoints["addition_copy"]})})
    try:
        check_teacher(url, checkpoints["addition"])
    finally:
        server.shutdown()


def test_a_teacher_with_another_tokenizer_is_refused(checkpoints):
    server, url = _serve({"/health": (200, {}), "/get_model_info": (200, {"model_path": checkpoints["sorting"]})})
    try:
        with pytest.raises(PreflightError, match=r"--teacher-url .*tokenizer .* differs from the student's"):
            check_teacher(url, checkpoints["addition"])
    finally:
        server.shutdown()


def test_a_remote_teacher_is_compared_by_vocab_size(checkpoints):
    server, url = _serve({"/health": (200, {}), "/get_model_info": (200, {"model_path": "org/remote", "vocab_size": 7})})
    try:
        with pytest.raises(PreflightError, match="vocab_size 7 differs from the student's"):
            check_teacher(url, checkpoints["addition"])
    finally:
        server.shutdown()


def test_a_teacher_that_is_not_ready_or_not_there_is_named(checkpoints):
    server, url = _serve({"/health": (503, {"error": "stalled"})})
    try:
        with pytest.raises(PreflightError, match=r"/health answered 503"):
            check_teacher(url, checkpoints["addition"])
    finally:
        server.shutdown()
    server.server_close()  # nothing listens there now
    with pytest.raises(PreflightError, match=r"--teacher-url .*: no answer from .*/health within 2 s"):
        check_teacher(url, checkpoints["addition"], timeout_s=2)


@pytest.mark.parametrize("key, size", [("tensor_model_parallel_size", 3), ("context_parallel_size", 3),
                                       ("tensor_model_parallel_size", 8)])
def test_a_parallel_degree_that_does_not_divide_the_heads_is_refused(checkpoints, key, size):
    run_config = RunConfig.from_dict({"hf_checkpoint": checkpoints["addition"], key: size})
    flag = "--" + key.replace("_", "-")
    with pytest.raises(PreflightError, match=rf"{flag} {size} does not divide the model's num_attention_heads 4 "
                                             r".*use one of \[1, 2, 4\]"):
        check_parallel_layout(run_config)


def test_parallel_degrees_that_divide_the_heads_pass(checkpoints):
    check_parallel_layout(RunConfig.from_dict({"hf_checkpoint": checkpoints["addition"],
                                               "tensor_model_parallel_size": 2, "context_parallel_size": 4}))


def test_a_custom_module_that_fails_to_import_is_named(tmp_path):
    broken = tmp_path / "broken_algo.py"
    broken.write_text("import no_such_package_for_stacx\n")
    with pytest.raises(PreflightError, match=r"--custom-module .*broken_algo.py.*No module named"):
        check_custom_modules(RunConfig.from_dict({"custom_module": [str(broken)]}))
