"""`stacx serve` takes SGLang's `text` prompts and answers with decoded `text` when its checkpoint
folder has a tokenizer; without one, `text` is refused with a 400 that says what to send."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from stacx.serving.cpu_engine import CpuEngine
from stacx.serving.server import EngineHttpServer
from stacx.tasks import write_tiny_checkpoint
from stacx.wire.sglang_protocol import parse_generate_payload


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("serve_text") / "ckpt"), "sorting", seed=0)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_text_prompts_are_encoded_like_input_ids(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    from_text, is_batch = parse_generate_payload({"text": ["3 1 2", "9 8"], "sampling_params": {"max_new_tokens": 2}},
                                                 tokenizer)
    ids = [tokenizer.encode("3 1 2"), tokenizer.encode("9 8")]
    from_ids, _ = parse_generate_payload({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert is_batch and from_text == from_ids
    with pytest.raises(ValueError, match="either 'text' or 'input_ids'"):
        parse_generate_payload({"text": "1 2", "input_ids": ids[0]}, tokenizer)
    with pytest.raises(ValueError, match=r"'text\[1\]' must be a non-empty string"):
        parse_generate_payload({"text": ["1 2", 5]}, tokenizer)


def test_serve_answers_text_with_the_decoded_completion(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    engine = CpuEngine.from_hf_checkpoint(checkpoint, params_dtype=torch.float32, seed=0)
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    with EngineHttpServer(engine, tokenizer=tokenizer) as server:
        status, by_text = _post(server.url, {"text": "4 2 3 1 0", "sampling_params": greedy})
        assert status == 200
        _, by_ids = _post(server.url, {"input_ids": tokenizer.encode("4 2 3 1 0"), "sampling_params": greedy})
    assert by_text["output_ids"] == by_ids["output_ids"] and len(by_text["output_ids"]) > 0
    assert by_text["text"] == tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    assert by_text["text"] != "" and by_ids["text"] == by_text["text"]  # token-id prompts get text answers too


def test_serve_without_a_tokenizer_refuses_text_with_a_400(checkpoint):
    engine = CpuEngine.from_hf_checkpoint(checkpoint, params_dtype=torch.float32, seed=0)
    with EngineHttpServer(engine) as server:
        status, answer = _post(server.url, {"text": "1 2", "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "send 'input_ids'" in json.dumps(answer)
