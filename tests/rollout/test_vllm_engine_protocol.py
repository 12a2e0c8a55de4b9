"""The vLLM engine's CPU-side logic without a vLLM server: wire format, registry, launch command, the
worker extension's checks (bucket header, versions, non-finite weights, read-back of fused parameters)
and the post-sync digest comparison. The same paths against a real vLLM server: tests/vllm/."""

import base64
import io
import json
import os

import numpy as np

import pytest
import torch

from stacx.parallel.tensor_buckets import plan_buckets, pack_bucket
from stacx.parallel.tensor_digests import tensor_digest
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.engines.vllm import WORKER_EXTENSION, VllmEngine, vllm_python, vllm_server_command
from stacx.rollout.engines.vllm_protocol import (
    build_abort_payload,
    build_completion_payload,
    build_rpc_payload,
    parse_completion_response,
    parse_rpc_results,
)
from stacx.rollout.engines.vllm_worker import stacx_vllm_worker as worker
from stacx.wire.types import GenerateRequest, SamplingParams
from stacx.rollout.weight_check import DigestingBuckets, WeightSyncMismatch, check_due, compare_digests


def test_completion_payload_sends_ids_and_asks_for_ids_and_log_probs():
    request = GenerateRequest(input_ids=(5, 6, 7), rid="r1", logprob_start_len=1, top_logprobs_num=2,
                              sampling=SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, seed=3,
                                                      stop_token_ids=(1,)))
    payload = build_completion_payload(request, model="m")
    assert payload["prompt"] == [5, 6, 7] and payload["max_tokens"] == 4 and payload["request_id"] == "r1"
    assert payload["return_token_ids"] and payload["return_tokens_as_token_ids"] and not payload["add_special_tokens"]
    assert (payload["logprobs"], payload["prompt_logprobs"], payload["seed"], payload["stop_token_ids"]) == (2, 2, 3, [1])
    assert build_abort_payload(None) == {"request_ids": []} and build_abort_payload(["a"]) == {"request_ids": ["cmpl-a-0"]}
    assert json.loads(build_rpc_payload("m", {"x": 1})["args"][0]) == {"x": 1}
    with pytest.raises(ValueError, match="worker-extension-cls"):
        parse_rpc_results({"results": "nope"}, "stacx_load_bucket")


def test_completion_answer_becomes_output_with_versions_prompt_log_probs_and_routes():
    routes = np.arange(2 * 3 * 2, dtype=np.int32).reshape(3, 2, 2)[:, :, ::-1]
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(routes))
    body = {"choices": [{"token_ids": [8, 9], "finish_reason": "abort", "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
                         "logprobs": {"tokens": ["token_id:8", "token_id:9"], "token_logprobs": [-0.5, -1.5],
                                      "top_logprobs": [{"token_id:8": -0.5, "token_id:3": -2.0},
                                                       {"token_id:4": -0.25, "token_id:9": -1.5}]},
                         "prompt_logprobs": [None, {"6": {"logprob": -3.0, "rank": 2}, "2": {"logprob": -0.1, "rank": 1}}]}]}
    request = GenerateRequest(input_ids=(5, 6), logprob_start_len=0, top_logprobs_num=2, return_routed_experts=True)
    out = parse_completion_response(body, request, weight_version=4)
    assert out.output_ids == [8, 9] and out.finish_reason == "abort" and out.output_token_versions == [4, 4]
    assert out.output_log_probs == [-0.5, -1.5] and out.output_top_log_probs[1] == [(-0.25, 4), (-1.5, 9)]
    assert out.input_log_probs == [None, -3.0] and out.input_top_log_probs[1] == [(-0.1, 2), (-3.0, 6)]
    assert out.routed_experts.shape == (3, 2, 2) and out.routed_experts[0, 0].tolist() == [0, 1]
    body["choices"][0]["logprobs"]["tokens"] = ["token_id:8", "token_id:7"]
    with pytest.raises(ValueError, match="do not match token_ids"):
        parse_completion_response(body, request, weight_version=4)


def encoded_routes(routes: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, routes)
    return base64.b64encode(buffer.getvalue()).decode()


def test_routes_in_vllms_narrow_dtypes_become_int32_and_an_abort_before_the_first_forward_carries_none():
    """vLLM 0.32 sends each token's experts in the narrowest dtype that holds every expert id (uint8 below 256
    experts), one row per forwarded token (the last sampled token has none), and no routes at all for a request
    aborted before its first forward (entrypoints/openai/completion/protocol.py, `routed_experts`)."""
    request = GenerateRequest(input_ids=(5, 6, 7), return_routed_experts=True)
    routes = np.array([[[3, 1]], [[0, 2]], [[1, 2]], [[3, 0]]], dtype=np.uint8)  # 3 prompt + 2 output - 1 tokens
    body = {"choices": [{"token_ids": [8, 9], "finish_reason": "length", "routed_experts": encoded_routes(routes),
                         "logprobs": {"tokens": ["token_id:8", "token_id:9"], "token_logprobs": [-0.5, -1.5]}}]}
    out = parse_completion_response(body, request, weight_version=1)
    assert out.routed_experts.dtype == torch.int32 and out.routed_experts[:, 0].tolist() == [[1, 3], [0, 2], [1, 2],
                                                                                              [0, 3]]
    aborted = {"choices": [{"token_ids": [], "finish_reason": "abort", "routed_experts": None,
                            "logprobs": {"tokens": [], "token_logprobs": []}}]}
    assert parse_completion_response(aborted, request, weight_version=1).routed_experts is None
    finished = {"choices": [{**aborted["choices"][0], "finish_reason": "length"}]}
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):  # a finished answer must carry them
        parse_completion_response(finished, request, weight_version=1)


def test_vllm_kind_is_registered_launches_or_attaches_and_names_its_python_flag(tmp_path, monkeypatch):
    kind = resolve_engine_kind("vllm")
    assert kind.client is VllmEngine and not kind.attaches
    assert kind.attaches_to(("http://127.0.0.1:1",)) and not kind.attaches_to(())
    monkeypatch.delenv("STACX_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="--vllm-python"):
        vllm_python(None)
    with pytest.raises(ValueError, match="setup_vllm_venv.sh"):
        vllm_python(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    command = vllm_server_command("py", str(tmp_path), port=5, return_routed_experts=True)
    assert command[command.index("--dtype") + 1] == "float32" and command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert "--enable-return-routed-experts" in command and "processed_logprobs" in command


def _header(bucket, *, version, index, final):
    slots, (num_bytes,) = plan_buckets(bucket)
    data = torch.empty(num_bytes, dtype=torch.uint8)
    pack_bucket(bucket, slots, 0, num_bytes, out=data)
    header = {"names": [s.name for s in slots], "dtypes": [s.dtype for s in slots], "shapes": [list(s.shape) for s in slots],
              "offsets": [s.offset for s in slots], "num_bytes": num_bytes, "version": version, "bucket": index,
              "final": final}
    return header, data


def test_worker_refuses_malformed_headers_replays_and_non_finite_weights():
    header, data = _header([("w", torch.ones(3))], version=1, index=0, final=True)
    assert [s.name for s in worker.parse_bucket_header(header, data.numel())] == ["w"]
    with pytest.raises(worker.BucketRefused, match="'num_bytes'"):
        worker.parse_bucket_header(header, data.numel() - 1)
    with pytest.raises(worker.BucketRefused, match="missing"):
        worker.parse_bucket_header({k: v for k, v in header.items() if k != "final"}, data.numel())
    with pytest.raises(worker.BucketRefused, match="not a stacx-weights"):
        worker.open_staging_file("/etc/passwd", 4)


def test_worker_opens_only_its_own_users_staging_file(monkeypatch):
    path = os.path.join("/dev/shm", f"{worker.STAGING_PREFIX}test-{os.getpid()}")
    with open(path, "wb") as handle:
        handle.write(b"\x01\x02\x03\x04")
    try:
        assert worker.open_staging_file(path, 4).tolist() == [1, 2, 3, 4]
        monkeypatch.setattr(worker.os, "getuid", lambda: os.stat(path).st_uid + 1)  # as another user's server
        with pytest.raises(worker.BucketRefused, match="belongs to uid"):
            worker.open_staging_file(path, 4)
    finally:
        os.remove(path)
    with pytest.raises(worker.BucketRefused, match="'w2' holds 1 NaN"):
        worker.refuse_non_finite([("w", torch.ones(2)), ("w2", torch.tensor([1.0, float("nan")]))])
    order = worker.VersionOrder()
    assert order.admit(1, 0) is True
    order.loading = (1, 0)
    assert order.admit(1, 1) is False
    with pytest.raises(worker.BucketRefused, match="sent once, in order"):
        order.admit(1, 0)
    order.served, order.loading = 1, None
    with pytest.raises(worker.BucketRefused, match="not newer"):
        order.admit(1, 0)


class _Fused(torch.nn.Module):
    """vLLM's fused projection: one [q; k; v] weight, `output_sizes` rows each; `repacked` empties the
    parameter and keeps only a CPU GEMM (as vLLM's oneDNN path does)."""

    def __init__(self, weight, sizes, repacked=False):
        super().__init__()
        self.output_sizes, self.input_size_per_partition = sizes, weight.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0) if repacked else weight.clone())
        if repacked:
            self.cpu_linear = lambda x, w, b: x @ weight.t()


class _Router(torch.nn.Module):
    """vLLM's replicated MoE router (`ReplicatedLinear`): `input_size` only; `repacked` as in `_Fused`."""

    def __init__(self, weight, repacked=False):
        super().__init__()
        self.input_size = weight.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0) if repacked else weight.clone())
        if repacked:
            self.cpu_linear = lambda x, w, b: x @ weight.t()


class _Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, weight, repacked, router):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = _Fused(weight, [4, 2, 2], repacked)
        self.experts = torch.nn.Module()
        self.experts.w13_weight = torch.nn.Parameter(torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3))
        # vLLM 0.32's Qwen3-MoE on CPU: the fused experts one module deeper, the router a replicated linear
        self.moe = torch.nn.Module()
        self.moe.experts = torch.nn.Module()
        self.moe.experts.routed_experts = torch.nn.Module()
        self.moe.experts.routed_experts.w2_weight = torch.nn.Parameter(torch.randn(2, 3, 4))
        self.moe.gate = _Router(router, repacked)


@pytest.mark.parametrize("repacked", [False, True])
def test_worker_reads_back_fused_and_expert_tensors_in_hugging_face_names(repacked):
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    router = torch.randn(2, 3)
    model = _Model(torch.cat([q, k, v]), repacked, router)
    params = dict(model.named_parameters())
    assert torch.equal(worker.read_back(model, params, "attn.k_proj.weight"), k)
    assert torch.equal(worker.read_back(model, params, "attn.v_proj.weight"), v)
    assert torch.equal(worker.read_back(model, params, "experts.1.up_proj.weight"), model.experts.w13_weight[1, 3:])
    assert torch.equal(worker.read_back(model, params, "moe.experts.1.down_proj.weight"),
                       model.moe.experts.routed_experts.w2_weight[1])
    assert torch.equal(worker.read_back(model, params, "moe.gate.weight"), router)
    assert worker.read_back(model, params, "not.a.weight") is None


class _LoraWrapped(torch.nn.Module):
    """vLLM's LoRA layer on a server with `--enable-lora`: the layer it wraps kept as `base_layer`."""

    def __init__(self, base_layer):
        super().__init__()
        self.base_layer = base_layer
        self.lora_a_stacked = torch.nn.Parameter(torch.zeros(1, 2, 3))


@pytest.mark.parametrize("repacked", [False, True])
def test_worker_reads_back_the_layers_a_lora_enabled_server_wrapped(repacked):
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    model = _Model(torch.cat([q, k, v]), repacked, torch.randn(2, 3))
    model.attn.qkv_proj = _LoraWrapped(model.attn.qkv_proj)
    o = torch.randn(3, 3)
    model.attn.o_proj = _LoraWrapped(_Router(o, repacked))
    params = dict(model.named_parameters())
    assert "attn.qkv_proj.base_layer.weight" in params and "attn.qkv_proj.weight" not in params
    assert torch.equal(worker.read_back(model, params, "attn.k_proj.weight"), k)
    assert torch.equal(worker.read_back(model, params, "attn.o_proj.weight"), o)
    assert worker.read_back(model, params, "attn.o_proj.lora_a_stacked") is not None  # not wrapped: itself
    assert worker.read_back(model, params, "attn.x_proj.weight") is None


def test_digests_compare_per_tensor_and_name_the_mismatch():
    assert tensor_digest(torch.tensor([-0.0, 1.0])) == tensor_digest(torch.tensor([0.0, 1.0]))
    assert tensor_digest(torch.ones(2, 3)) != tensor_digest(torch.ones(3, 2))
    assert tensor_digest(torch.ones(2, dtype=torch.float32), dtype=torch.bfloat16) == tensor_digest(
        torch.ones(2, dtype=torch.bfloat16))
    digesting = DigestingBuckets([[("a", torch.ones(2))], [("b", torch.zeros(2))]])
    assert [len(b) for b in digesting] == [1, 1] and set(digesting.digests) == {"a", "b"}
    held = dict(digesting.digests, c=None)
    assert compare_digests({**digesting.digests, "c": "x"}, held, url="u", version=2) == ["c"]
    with pytest.raises(WeightSyncMismatch, match="version 2.*'?b'?") as caught:
        compare_digests(digesting.digests, {"a": digesting.digests["a"], "b": "other"}, url="u", version=2)
    assert caught.value.names == ["b"]
    assert [check_due(v, 3) for v in (1, 3, 6)] == [False, True, True] and not check_due(5, 0)


def test_an_update_goes_to_the_workers_numbered_and_staged_in_the_clients_own_file():
    """`VllmEngine.update_weights` over the same-host staging file: buckets 0, 1, ... under the version, only
    the last final, each staged whole (the file grows for a larger bucket) and the file removed at shutdown."""
    engine = VllmEngine("http://127.0.0.1:9", weight_transport="shm")
    received = []

    def rpc(method, header):
        assert method == "stacx_load_bucket"
        tensors = worker.open_staging_file(header["staging_path"], header["num_bytes"])  # the worker's own check
        slots = worker.parse_bucket_header(header, header["num_bytes"])
        received.append((header["version"], header["bucket"], header["final"],
                         {name: tensor.clone() for name, tensor in worker.unpack_bucket(tensors, slots).items()}))
        return [{"loaded": len(header["names"])}]

    engine.rpc = rpc
    buckets = [[("a", torch.arange(3, dtype=torch.float32))],
               [("b", torch.arange(100, dtype=torch.float32)), ("c", torch.ones(2, 2, dtype=torch.bfloat16))]]
    try:
        engine.update_weights(iter(buckets), version=3)
        staging_path = engine._staging.path
    finally:
        engine.shutdown()
    assert [(version, index, final) for version, index, final, _ in received] == [(3, 0, False), (3, 1, True)]
    for sent, (_, _, _, got) in zip(buckets, received):
        assert list(got) == [name for name, _ in sent]
        assert all(torch.equal(got[name], tensor) for name, tensor in sent)
    assert not os.path.exists(staging_path)
    refusing = VllmEngine("http://127.0.0.1:9", weight_transport="http")
    try:
        with pytest.raises(ValueError, match="no buckets given"):
            refusing.update_weights([], version=4)
    finally:
        refusing.shutdown()


def test_launched_servers_are_ready_together_or_all_stopped():
    """`LocalServerGroup` (the cpu and vllm kinds' launched servers): every URL once all are ready; when one
    fails to start, every server is stopped before the error goes on."""
    from stacx.rollout.engines.launchers import LaunchedCpuServer
    from stacx.rollout.engines.vllm import LaunchedVllmServers

    class Server:
        def __init__(self, url):
            self.url, self.stopped = url, False

        def wait_until_ready(self):
            if self.url is None:
                raise RuntimeError("server exited before it was ready")
            return self.url

        def stop(self):
            self.stopped = True

    ready = [Server("http://127.0.0.1:1"), Server("http://127.0.0.1:2")]
    assert LaunchedVllmServers(ready).wait_until_ready() == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert LaunchedCpuServer(ready[0], None, [ready[1]]).wait_until_ready() == ("http://127.0.0.1:1",
                                                                                "http://127.0.0.1:2")
    assert not any(server.stopped for server in ready)
    for launched in (lambda servers: LaunchedVllmServers(servers), lambda servers: LaunchedCpuServer(servers[0], None,
                                                                                                    servers[1:])):
        servers = [Server("http://127.0.0.1:1"), Server(None), Server("http://127.0.0.1:3")]
        with pytest.raises(RuntimeError, match="exited before it was ready"):
            launched(servers).wait_until_ready()
        assert all(server.stopped for server in servers)


def test_a_cpu_server_refusing_routed_experts_stops_the_start_naming_the_flag_and_why(tmp_path):
    """vLLM 0.32 captures routed experts only in its V2 model runner, which needs Triton: its CPU build refuses
    --enable-return-routed-experts at start-up (config/vllm.py). The start fails at once, naming the run's flag."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig'\n"
                    "echo '  Value error, Model Runner V2 requires Triton. [type=value_error]'\nexit 1\n")
    fake.chmod(0o755)
    server = VllmServerProcess(str(tmp_path), python=str(fake), return_routed_experts=True, timeout_s=60, wait=False)
    with pytest.raises(RuntimeError, match=r"needs Triton.*--use-routing-replay needs a vLLM server on a GPU"):
        server.wait_until_ready()


class _FakeCpuExperts:
    """vLLM 0.32's `CPUUnquantizedExperts`: its processing prepacks the fused weights (here: each expert's rows
    reversed and its columns rolled, a permutation within each expert)."""

    isa = "vec"

    def __init__(self, intermediate):
        self.moe_config = type("MoEConfig", (), {"intermediate_size_per_partition": intermediate})()

    def _padded_intermediate_size(self, moe_config):
        return moe_config.intermediate_size_per_partition

    def process_weights_after_loading(self, layer):
        layer.w13_weight = torch.nn.Parameter(prepack(layer.w13_weight.data))


def prepack(weight, isa="vec"):
    return weight.flip(1).roll(1, dims=2).contiguous()


class _FakeUnquantizedMoEMethod:
    """vLLM 0.32's `UnquantizedFusedMoEMethod`: prepacks on the first load only; on an update it copies the new
    plain weights in and skips the kernel's processing (the bug the worker works around)."""

    def __init__(self, experts):
        self.moe_kernel = type("Kernel", (), {"fused_experts": experts})()

    def process_weights_after_loading(self, layer):
        pass


def test_worker_reads_experts_through_vllms_cpu_prepacked_layout_and_prepacks_them_again_after_an_update(monkeypatch):
    """On CPU, vLLM 0.32 keeps fused expert weights prepacked and, after a weight update, leaves them plain (its
    kernel then reads them in the wrong layout: 1.5e-2 of log-prob off on the tiny Qwen3-MoE while the raw
    parameters' digests matched). The read-back unpacks, so an unprepacked update is caught; the worker prepacks
    after every update, so the served experts are the sent ones."""
    import sys
    import types

    cpu_moe = types.ModuleType("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    cpu_moe.CPUUnquantizedExperts = _FakeCpuExperts
    ops = types.ModuleType("vllm._custom_ops")
    ops.cpu_prepack_moe_weight = prepack
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe",
                 "vllm.model_executor.layers.fused_moe.experts"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, cpu_moe.__name__, cpu_moe)
    monkeypatch.setitem(sys.modules, ops.__name__, ops)
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    layer = model.experts.routed_experts = torch.nn.Module()
    layer.quant_method = _FakeUnquantizedMoEMethod(_FakeCpuExperts(intermediate=3))
    first, update = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    layer.w13_weight = torch.nn.Parameter(prepack(first))  # as served after the first load

    def read(name):
        return worker.read_back(model, dict(model.named_parameters()), name)

    assert torch.equal(read("experts.1.gate_proj.weight"), first[1, :3])
    layer.w13_weight.data.copy_(update)  # vLLM's update: the new weights copied in plain
    layer.quant_method.process_weights_after_loading(layer)
    assert not torch.equal(read("experts.1.up_proj.weight"), update[1, 3:])  # caught: not what was sent
    worker.keep_cpu_experts_prepacked(model)
    layer.w13_weight.data.copy_(update)
    layer.quant_method.process_weights_after_loading(layer)  # now prepacks after the update
    assert torch.equal(read("experts.1.up_proj.weight"), update[1, 3:])
    assert torch.equal(read("experts.0.gate_proj.weight"), update[0, :3])


KEYED_FAKE_VLLM = '''#!{python}
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
import os
key = os.environ.get("VLLM_API_KEY")

class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, body):
        if self.path != "/health" and self.headers.get("Authorization") != f"Bearer {{key}}":
            self.send_response(401); self.end_headers(); self.wfile.write(b'{{"error": "Unauthorized"}}'); return
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.answer({{"data": [{{"id": "stacx-policy"}}]}})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer({{"choices": [{{"token_ids": [3], "finish_reason": "length"}}]}})
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_a_server_the_run_starts_with_its_key_is_ready_once_it_answers_the_keyed_first_request(tmp_path):
    """A run's own vLLM server takes the run's key (VLLM_API_KEY): the readiness probe's first request sends it
    (it did not: every launched server failed its first request with a 401, and `--rollout-engine vllm` without
    `--rollout-urls` could not start)."""
    import sys

    from stacx.rollout.engines.vllm import VllmServerProcess

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    fake = tmp_path / "python"
    fake.write_text(KEYED_FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    server = VllmServerProcess(str(tmp_path), python=str(fake), api_key="run-key", timeout_s=60)
    try:
        assert server.url is not None
    finally:
        server.stop()
