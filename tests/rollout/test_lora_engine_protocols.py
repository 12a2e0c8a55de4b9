"""Adapter-only weight pushes (--lora-sync adapters) into vLLM and SGLang, protocol-tested against fake servers on
CPU: the engines receive the adapters in PEFT's format through their own LoRA loading (vLLM's
`/v1/load_lora_adapter` of a PEFT folder, SGLang's `/load_lora_adapter_from_tensors`), never merged weights, and
generation then names the adapter. Against a real vLLM server: tests/vllm/test_vllm_lora.py; a real SGLang server:
tests/rollout/test_sglang_lora_gpu.py."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file

from stacx.wire.http_client import RetryPolicy
from stacx.wire.types import GenerateRequest, SamplingParams

ONE_TRY = RetryPolicy(max_attempts=1, timeout_s=30)
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["down_proj", "k_proj", "q_proj", "v_proj"]}


def adapter_buckets(scale: float = 1.0) -> list:
    """What `iter_hf_weight_buckets(..., adapters=True)` streams for one layer: q/k/v's one A under q's name."""
    layer = "model.layers.0"
    a, b = torch.full((2, 4), scale), torch.arange(12.0).reshape(6, 2) * scale
    return [[(f"{layer}.self_attn.q_proj.lora_A.weight", a), (f"{layer}.self_attn.q_proj.lora_B.weight", b[:2]),
             (f"{layer}.self_attn.k_proj.lora_B.weight", b[2:4])],
            [(f"{layer}.self_attn.v_proj.lora_B.weight", b[4:]), (f"{layer}.mlp.down_proj.lora_A.weight", a[:, :3]),
             (f"{layer}.mlp.down_proj.lora_B.weight", b[:4])]]


class FakeServer(BaseHTTPRequestHandler):
    """Records (path, JSON body); answers with `server.answer(path, body)`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply(self.server.answer(self.path, None))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.server.calls.append((self.path, body))
        try:
            answer = self.server.answer(self.path, body)
        except ValueError as err:  # a refused call: an error answer, as the servers give
            return self._reply({"error": str(err)}, status=400)
        self._reply(answer)

    def _reply(self, answer, status=200):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def serve():
    servers = []

    def start(answer):
        server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
        server.calls, server.answer = [], answer
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# ---- vLLM ------------------------------------------------------------------------------------------------------


class FakeVllm:
    """vLLM's LoRA endpoints and the worker extension's version calls, with the worker's real VersionOrder."""

    def __init__(self):
        from stacx.rollout.engines.vllm_worker import stacx_vllm_worker as worker

        self.worker = type("Worker", (worker.StacxWorkerExtension,), {})()
        self.adapters = {}
        self.loaded = []

    def __call__(self, path, body):
        from stacx.rollout.engines.vllm import SERVED_MODEL_NAME

        if path == "/v1/models":
            return {"data": [{"id": SERVED_MODEL_NAME}] + [{"id": name} for name in self.adapters]}
        if path == "/v1/load_lora_adapter":  # vLLM reads the folder now: the test reads it as vLLM would
            folder = body["lora_path"]
            self.loaded.append((body, load_file(os.path.join(folder, "adapter_model.safetensors")),
                                json.load(open(os.path.join(folder, "adapter_config.json")))))
            self.adapters[body["lora_name"]] = folder
            return "Success"
        if path == "/collective_rpc":
            method = getattr(self.worker, body["method"])
            return {"results": [method(*body.get("args", []))]}
        if path == "/v1/completions":
            return {"choices": [{"token_ids": [5], "finish_reason": "length",
                                 "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}}]}
        raise AssertionError(path)


def test_a_vllm_adapter_push_loads_a_peft_folder_and_generation_asks_for_the_adapter(serve):
    from stacx.rollout.engines.vllm import LORA_ADAPTER_NAME, SERVED_MODEL_NAME, VllmEngine

    fake = FakeVllm()
    server, url = serve(fake)
    # The fake answers completions unstreamed (streaming has its own tests: test_streamed_vllm_completions.py).
    pusher, driver = VllmEngine(url, retry=ONE_TRY), VllmEngine(url, retry=ONE_TRY, stream_progress=False)
    with pytest.raises(ValueError, match="use_lora_config"):
        pusher.update_weights(adapter_buckets(), version=1)
    assert driver.weight_version() == 0 and driver.model_name() == SERVED_MODEL_NAME
    pusher.use_lora_config(CONFIG)
    pusher.update_weights(adapter_buckets(), version=1)
    pusher.update_weights(adapter_buckets(scale=2.0), version=2)

    (first, first_tensors, config), (second, second_tensors, _) = fake.loaded
    assert config == CONFIG
    assert first["lora_name"] == second["lora_name"] == LORA_ADAPTER_NAME and second["load_inplace"] is True
    assert first["lora_path"] != second["lora_path"]  # a new folder per version: nothing cached of the last one
    assert not os.path.exists(first["lora_path"]) and os.path.isdir(second["lora_path"])
    prefix = "base_model.model.model.layers.0."
    sent = {name: tensor for bucket in adapter_buckets(scale=2.0) for name, tensor in bucket}
    assert sorted(second_tensors) == sorted(["base_model.model." + name for name in sent]
                                            + [prefix + "self_attn.k_proj.lora_A.weight",
                                               prefix + "self_attn.v_proj.lora_A.weight"])
    for name, tensor in sent.items():
        assert torch.equal(second_tensors["base_model.model." + name], tensor)
    for sibling in ("k_proj", "v_proj"):  # the fused qkv's one A, repeated for each module
        assert torch.equal(second_tensors[f"{prefix}self_attn.{sibling}.lora_A.weight"],
                           sent["model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert not any("/update" in path or "stacx_load_bucket" in json.dumps(body) for path, body in server.calls)

    assert driver.weight_version() == 2  # the worker serves the adapters' version; the driver finds the adapter
    driver.generate([GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=1))])
    assert server.calls[-1][0] == "/v1/completions" and server.calls[-1][1]["model"] == LORA_ADAPTER_NAME
    with pytest.raises(Exception, match="not newer"):  # versions only move forward, as for weights
        pusher.update_weights(adapter_buckets(), version=2)
    folder = pusher._lora_folder
    pusher.shutdown()
    assert not os.path.exists(folder)
    driver.shutdown()


def test_a_vllm_adapter_push_to_another_host_is_refused_naming_the_fix():
    from stacx.rollout.engines.vllm import VllmEngine

    engine = VllmEngine("http://10.0.0.7:8000", retry=ONE_TRY)
    engine.use_lora_config(CONFIG)
    with pytest.raises(ValueError, match="--lora-sync merged"):
        engine.update_weights(adapter_buckets(), version=1)
    engine.shutdown()


def test_vllm_and_sglang_servers_start_with_lora_for_an_adapter_sync(tmp_path):
    from stacx.rollout.engines.registry import ENGINE_KINDS
    from stacx.rollout.engines.sglang import sglang_lora_args
    from stacx.rollout.engines.vllm import LORA_UPDATING_ENV, lora_rank_of_flags, vllm_server_command, vllm_server_env

    flags = ("--lora-rank", "4", "--lora-alpha", "8.0", "--lora-target-modules", "linear_qkv",
             "--lora-target-modules", "linear_fc2")
    command = vllm_server_command("py", str(tmp_path), port=5, lora_rank=lora_rank_of_flags(flags))
    assert command[command.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in command  # vLLM's ranks: 1, 8, ..
    assert vllm_server_env(None, lora=True)[LORA_UPDATING_ENV] == "True"
    assert LORA_UPDATING_ENV not in vllm_server_env(None) and "--enable-lora" not in vllm_server_command("py", str(tmp_path), port=5)
    assert lora_rank_of_flags(()) is None
    assert sglang_lora_args(flags) == ["--enable-lora", "--max-lora-rank", "4", "--max-loras-per-batch", "1",
                                       "--lora-target-modules", "down_proj", "k_proj", "q_proj", "v_proj"]
    assert {name for name, kind in ENGINE_KINDS.items() if kind.takes_lora_adapters} >= {"cpu", "vllm", "sglang"}


# ---- SGLang ----------------------------------------------------------------------------------------------------


class FakeSglang:
    """SGLang's LoRA API: adapters by name, a weight version set by /update_weight_version."""

    def __init__(self):
        self.adapters, self.version = [], "default"

    def __call__(self, path, body):
        if path == "/load_lora_adapter_from_tensors":
            self.adapters.append(body["lora_name"])
        elif path == "/unload_lora_adapter":
            self.adapters.remove(body["lora_name"])
        elif path == "/update_weight_version":
            self.version = body["new_version"]
        elif path == "/get_model_info":
            return {"model_path": "fake", "weight_version": self.version}
        elif path == "/v1/models":
            return {"data": [{"id": "fake"}] + [{"id": name} for name in self.adapters]}
        elif path == "/generate":
            return [{"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": self.version,
                                                      "output_token_logprobs": [[-0.5, 5, None]]}}
                    for _ in body["input_ids"]]
        return {"success": True, "message": "ok"}


def test_an_sglang_adapter_push_loads_versioned_adapters_and_generation_names_the_newest(serve):
    from stacx.rollout.engines.sglang import SglangEngine

    fake = FakeSglang()
    server, url = serve(fake)
    serialized = []

    def serializer(tensors):
        serialized.append(tensors)
        return f"{len(tensors)} tensors"

    pusher = SglangEngine(url, serializer=serializer, server_tp_size=1, retry=ONE_TRY)
    with pytest.raises(ValueError, match="use_lora_config"):
        pusher.update_weights(adapter_buckets(), version=1)
    pusher.use_lora_config(CONFIG)
    pusher.update_weights(adapter_buckets(), version=1)
    pusher.update_weights(adapter_buckets(scale=2.0), version=2)
    assert server.calls == [
        ("/load_lora_adapter_from_tensors", {"lora_name": "stacx-policy-lora-v1", "config_dict": CONFIG,
                                             "serialized_tensors": "8 tensors", "load_format": None}),
        ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
        ("/load_lora_adapter_from_tensors", {"lora_name": "stacx-policy-lora-v2", "config_dict": CONFIG,
                                             "serialized_tensors": "8 tensors", "load_format": None}),
        ("/update_weight_version", {"new_version": "2", "abort_all_requests": False}),
        ("/unload_lora_adapter", {"lora_name": "stacx-policy-lora-v1"}),
    ]
    tensors = serialized[-1]  # PEFT names, the shared A repeated: what PEFT's own state dict holds
    assert torch.equal(tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"],
                       tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert fake.adapters == ["stacx-policy-lora-v2"]

    driver = SglangEngine(url, retry=ONE_TRY)  # the driver's client: it did not push, it finds the adapter
    assert driver.weight_version() == 2
    requests = [GenerateRequest(input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=1))] * 2
    outputs = driver.generate(requests)
    assert server.calls[-1][0] == "/generate" and server.calls[-1][1]["lora_path"] == ["stacx-policy-lora-v2"] * 2
    assert [o.output_ids for o in outputs] == [[5], [5]]
    pusher.shutdown()
    driver.shutdown()


def test_an_sglang_weight_push_of_base_weights_is_not_taken_for_adapters(serve):
    from stacx.rollout.engines.sglang import SglangEngine

    fake = FakeSglang()
    server, url = serve(fake)
    engine = SglangEngine(url, serializer=lambda named: "x", server_tp_size=1, retry=ONE_TRY)
    engine.use_lora_config(CONFIG)
    engine.update_weights([[("model.norm.weight", torch.ones(4))]], version=3)
    assert [path for path, _ in server.calls] == ["/update_weights_from_tensor"]
    engine.shutdown()
