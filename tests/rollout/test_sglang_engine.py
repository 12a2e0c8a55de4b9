"""SGLang engine: weight-update requests and the trainer's broadcast group, against a fake SGLang server."""

import json
import pathlib
import socket
import threading
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from stacx.parallel.tensor_buckets import TENSOR_DTYPES
from stacx.rollout.engines.sglang import (
    SglangEngine,
    SglangServerSpec,
    WeightBroadcastGroup,
    build_launch_command,
)
from stacx.wire.http_client import RetryPolicy
from stacx.wire.types import GenerateRequest, SamplingParams


class FakeSglang(BaseHTTPRequestHandler):
    """Records JSON bodies; joins the weight group as rank 1 and receives broadcasts like SGLang does."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/get_server_info":  # SGLang's server args, `tp_size` among them
            self.server.state.setdefault("calls", []).append((self.path, None))
            return self._answer({"tp_size": 2, "model_path": "fake"})
        self._answer({"model_path": "fake", "weight_version": self.server.state.get("version", "0")})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        state = self.server.state
        state.setdefault("calls", []).append((self.path, body))
        if self.path == "/init_weights_update_group":
            state["group"] = WeightBroadcastGroup(master_address=body["master_address"], master_port=body["master_port"],
                                                  world_size=body["world_size"], rank=body["rank_offset"], backend=body["backend"])
        elif self.path == "/update_weights_from_distributed":
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                tensor = torch.empty(shape, dtype=TENSOR_DTYPES[dtype])
                state["group"].broadcast(tensor)
                state.setdefault("received", {})[name] = tensor
            state["version"] = body["weight_version"]
        elif self.path == "/update_weights_from_tensor":
            state["version"] = body["weight_version"]
        elif self.path == "/abort_request":
            return self._answer(None)  # SGLang answers an empty 200
        elif self.path == "/generate":
            return self._answer(state["generate_answer"])
        self._answer({"success": True, "message": "ok"})

    def _answer(self, body):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_sglang():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSglang)
    server.state = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _buckets():
    g = torch.Generator().manual_seed(0)
    return [[("model.embed_tokens.weight", torch.randn(5, 4, generator=g)),
             ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16))],
            [("lm_head.weight", torch.randn(5, 4, generator=g))]]


def test_update_from_tensor_requests(fake_sglang):
    url = f"http://127.0.0.1:{fake_sglang.server_address[1]}"
    engine = SglangEngine(url, weight_update="tensor", serializer=lambda named: "|".join(n for n, _ in named),
                          server_tp_size=2, retry=RetryPolicy(max_attempts=1))
    engine.update_weights(_buckets(), version=4)
    calls = fake_sglang.state["calls"]
    assert calls == [
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["model.embed_tokens.weight|model.norm.weight"] * 2,
                                         "load_format": None, "flush_cache": False, "weight_version": "4"}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["lm_head.weight"] * 2,
                                         "load_format": None, "flush_cache": True, "weight_version": "4"}),
    ]
    assert engine.weight_version() == 4


def test_update_from_tensor_sends_one_entry_per_tp_rank_the_server_reports(fake_sglang):
    url = f"http://127.0.0.1:{fake_sglang.server_address[1]}"
    engine = SglangEngine(url, weight_update="tensor", serializer=lambda named: "|".join(n for n, _ in named),
                          retry=RetryPolicy(max_attempts=1))  # as `engine_client("sglang", url)` builds it
    engine.update_weights(_buckets(), version=2)
    calls = fake_sglang.state["calls"]
    assert [path for path, _ in calls] == ["/get_server_info"] + ["/update_weights_from_tensor"] * 2  # asked once
    assert [body["serialized_named_tensors"] for _, body in calls[1:]] == [
        ["model.embed_tokens.weight|model.norm.weight"] * 2, ["lm_head.weight"] * 2]


def test_update_from_distributed_broadcasts_every_tensor(fake_sglang):
    url = f"http://127.0.0.1:{fake_sglang.server_address[1]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = SglangEngine(url, weight_update="distributed", retry=RetryPolicy(max_attempts=1, timeout_s=60))
    with pytest.raises(RuntimeError, match="init_weight_update_group"):
        engine.update_weights(_buckets(), version=1)
    engine.init_weight_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                                    backend="gloo")
    engine.update_weights(_buckets(), version=9)
    paths = [p for p, _ in fake_sglang.state["calls"]]
    assert paths == ["/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_distributed"]
    first = fake_sglang.state["calls"][1][1]
    assert first == {"names": ["model.embed_tokens.weight", "model.norm.weight"], "dtypes": ["float32", "bfloat16"],
                     "shapes": [[5, 4], [4]], "group_name": "weight_update_group", "flush_cache": False,
                     "weight_version": "9"}
    for name, tensor in [pair for bucket in _buckets() for pair in bucket]:
        assert torch.equal(fake_sglang.state["received"][name], tensor)
    assert engine.weight_version() == 9


def test_launch_command():
    command = build_launch_command(SglangServerSpec(model_path="/m", port=31000, tensor_model_parallel_size=2))
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert command[command.index("--tp-size") + 1] == "2" and command[command.index("--port") + 1] == "31000"
    with pytest.raises(ValueError, match="weight_update"):
        SglangEngine("http://x", weight_update="disk")


def test_sglang_servers_that_never_come_up_fail_with_their_gpu_needs_and_are_killed(monkeypatch):
    """A cluster without free GPUs leaves the actors pending: the launch times out naming what it
    needed, and kills every actor it started (no Ray cluster needed: ray's calls are replaced)."""
    import ray

    from stacx.rollout.engines import sglang as sglang_engine

    killed = []

    class PendingActor:
        def __init__(self, spec):
            self.spec = spec
            self.__ray_call__ = SimpleNamespace(remote=lambda fn: ("url of", spec.model_path))

    class FakeActorClass:
        def options(self, num_gpus):
            return SimpleNamespace(remote=lambda spec, startup_timeout_s: PendingActor(spec))

    def get(refs, timeout):
        assert timeout == 5 + sglang_engine.SGLANG_SCHEDULING_MARGIN_S
        raise ray.exceptions.GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "remote", lambda cls: FakeActorClass())
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor: killed.append(actor.spec.model_path))
    specs = [SglangServerSpec(model_path="policy", port=30000, tensor_model_parallel_size=2),
             SglangServerSpec(model_path="teacher", port=30001)]
    with pytest.raises(RuntimeError, match=r"policy: 2 GPU\(s\), teacher: 1 GPU\(s\)"):
        sglang_engine.launch_sglang_servers_on_ray(specs, startup_timeout_s=5)
    assert killed == ["policy", "teacher"]


def test_abort_requests_and_an_aborted_answer(fake_sglang):
    """SglangEngine.abort posts SGLang's /abort_request shapes; the aborted request's own /generate
    answer (recorded shape) comes back as a partial output with a version per token."""
    recorded = json.loads((pathlib.Path(__file__).parents[1] / "wire" / "payloads" / "sglang_generate_abort.json").read_text())
    fake_sglang.state["generate_answer"] = recorded["response"]
    engine = SglangEngine(f"http://127.0.0.1:{fake_sglang.server_address[1]}", retry=RetryPolicy(max_attempts=1))
    requests = [GenerateRequest(input_ids=tuple(ids), rid=rid, sampling=SamplingParams(
        max_new_tokens=8, temperature=0.8, seed=params["sampling_seed"]))
        for ids, rid, params in zip(recorded["request"]["input_ids"], recorded["request"]["rid"],
                                    recorded["request"]["sampling_params"])]
    partial, queued = engine.generate(requests)
    engine.abort(["rollout-0"])
    engine.abort()
    calls = fake_sglang.state["calls"]
    assert calls == [("/generate", recorded["request"]), ("/abort_request", recorded["abort_one"]),
                     ("/abort_request", recorded["abort_all"])]
    assert partial.finish_reason == "abort" and partial.output_token_versions == [7, 7, 7]
    assert queued.finish_reason == "abort" and queued.output_ids == []
    engine.shutdown()
