"""The trainer's side of vLLM's weight-transfer API (`--vllm-weight-transfer nccl|gloo`) on CPU, against a fake
vLLM server that replays vLLM 0.32's request and answer schema (`entrypoints/rl/online/api_router.py`, the NCCL
engine's init and update info) and its worker's session rules (start, update, finish), and that joins a real
gloo group as the server's one worker: the endpoints and their order, the init-once rendezvous, one update per
bucket with the tensors received in order, version bookkeeping, refusals before anything is sent, the NCCL
payload (a unique id in vLLM's form) and its refusal on a CPU rank, which rank sends, and the flag's plumbing.

Not here: vLLM's own NCCL communicator (tests/rollout/test_vllm_nccl_weight_push_gpu.py, marked gpu) and the
gloo engine inside a real vLLM worker (tests/vllm/test_vllm_weight_transfer.py, the vllm tier)."""

from __future__ import annotations

import base64
import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from stacx.parallel.weight_broadcast import NCCL_UNIQUE_ID_BYTES, WeightBroadcastGroup
from stacx.rollout.engines import vllm_weight_transfer as transfer
from stacx.rollout.engines.registry import engine_client
from stacx.rollout.engines.vllm import VLLM_WEIGHT_TRANSFERS, VllmEngine, vllm_server_command
from stacx.rollout.engines.vllm_worker import stacx_vllm_worker as worker
from stacx.rollout.sections import RolloutSection
from stacx.trainer.config.run import FIELD_CHOICES
from stacx.wire.types import EngineTarget
from tests.json_routes import answer_json

# vLLM 0.32's NCCLWeightTransferInitInfo (nccl_common.py) and NCCLWeightTransferUpdateInfo (nccl_engine.py) fields
INIT_INFO_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}
UPDATE_INFO_FIELDS = {"names", "dtype_names", "shapes"}


class FakeVllm:
    """vLLM 0.32's RL routes and /collective_rpc for the Stacx worker extension, one worker (world size 1).

    A route answers as vLLM's does (FastAPI: a missing embedded body field is a 422; an error raised inside the
    worker a 500). `joins`: 'gloo' joins the trainer's store as rank `rank_offset` of the init info and receives
    every tensor an update names; None only checks the payloads (the NCCL unique-id path, no group here)."""

    def __init__(self, *, backend: str | None = "stacx_gloo", joins: str | None = "gloo"):
        self.backend, self.joins = backend, joins
        self.calls: list[tuple[str, object]] = []
        self.received: list[tuple[str, torch.Tensor]] = []
        self.active = False
        self.vllm_version: str | None = None
        self.order = worker.VersionOrder()
        self.group = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status, body):
                answer_json(self, status, body)

            def do_GET(self):
                fake.calls.append((self.path, None))
                if self.path == "/get_world_size":
                    self._answer(200, {"world_size": 1})
                else:
                    self._answer(404, {"detail": "Not Found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                name = body["method"] if self.path == "/collective_rpc" else self.path
                fake.calls.append((name, body))
                try:
                    self._answer(*fake.route(self.path, body))
                except Exception as err:  # noqa: BLE001 - as vLLM's worker errors reach the client
                    self._answer(500, {"error": f"{type(err).__name__}: {err}"})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def route(self, path: str, body):
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            assert set(info) <= INIT_INFO_FIELDS and {"rank_offset", "world_size"} <= set(info), info
            uid = info.get("nccl_unique_id_b64")
            assert (uid is None) == ("master_address" in info and "master_port" in info), "one rendezvous mode"
            if uid is not None:
                assert len(base64.b64decode(uid, validate=True)) == NCCL_UNIQUE_ID_BYTES
            if self.backend is None:
                raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable "
                                   "weight transfer.")
            if self.joins == "gloo":
                self.group = WeightBroadcastGroup(master_address=info["master_address"], master_port=info["master_port"],
                                                  world_size=info["world_size"], rank=info["rank_offset"],
                                                  backend="gloo", timeout_s=30)
            return 200, {"message": "Weight transfer initialized"}
        if path == "/start_weight_update":
            if self.active:
                raise RuntimeError("start_weight_update called while a weight update is already active.")
            self.active = True
            return 200, {"message": "Weight update started"}
        if path == "/update_weights":
            if "update_info" not in body:
                return 422, {"detail": [{"loc": ["body", "update_info"], "msg": "Field required"}]}
            info = body["update_info"]
            assert set(info) == UPDATE_INFO_FIELDS and len({len(v) for v in info.values()}) == 1, info
            if not self.active:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                if self.group is not None:
                    self.group.broadcast(tensor)
                self.received.append((name, tensor))
            return 200, {"message": "Weights updated"}
        if path == "/finish_weight_update":
            assert body is None or set(body) <= {"weight_version"}
            if not self.active:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
            self.active = False
            return 200, {"message": "Weight update finished"}
        if path == "/update_weight_version":
            if not isinstance(body.get("new_version"), str):
                return 422, {"detail": [{"loc": ["body", "new_version"], "msg": "Input should be a valid string"}]}
            self.vllm_version = body["new_version"]
            return 200, {"success": True, "new_version": body["new_version"]}
        if path == "/collective_rpc":
            method, args = body["method"], [json.loads(a) for a in body["args"]]
            if method == "stacx_weight_version":
                return 200, {"results": [{"weight_version": self.order.served}]}
            if method == "stacx_weight_transfer":
                return 200, {"results": [{"backend": self.backend}]}
            if method == "stacx_transfer_finished":
                self.order.admit(args[0]["version"], 0)
                self.order.served = args[0]["version"]
                return 200, {"results": [{"weight_version": self.order.served}]}
        return 404, {"detail": "Not Found"}

    def close(self):
        self.server.shutdown()


@pytest.fixture
def fake_vllm():
    servers = []

    def make(**kwargs):
        servers.append(FakeVllm(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def buckets(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [[("model.embed_tokens.weight", torch.randn(6, 4, generator=generator)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=generator))],
            [("model.norm.weight", torch.randn(4, generator=generator).to(torch.bfloat16))]]


def test_a_gloo_push_joins_once_sends_one_update_per_bucket_in_order_and_records_the_version(fake_vllm):
    server = fake_vllm()
    engine = VllmEngine(server.url, weight_transport="gloo")
    try:
        sent = buckets(0)
        engine.update_weights(iter(sent), version=1)
        assert server.names() == ["stacx_weight_version", "stacx_weight_transfer", "/get_world_size",
                                  "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                  "/update_weights", "/finish_weight_update", "/update_weight_version",
                                  "stacx_transfer_finished"]
        init_info = server.calls[3][1]["init_info"]
        assert init_info == {"master_address": "127.0.0.1", "master_port": init_info["master_port"], "rank_offset": 1,
                             "world_size": 2, "packed": False}
        assert server.calls[5][1] == {"update_info": {
            "names": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
            "dtype_names": ["float32", "float32"], "shapes": [[6, 4], [4, 4]]}}
        assert server.calls[6][1]["update_info"]["dtype_names"] == ["bfloat16"]
        flat = [pair for bucket in sent for pair in bucket]
        assert [name for name, _ in server.received] == [name for name, _ in flat]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(server.received, flat))
        assert server.calls[8][1] == {"new_version": "1"} and server.order.served == 1 and engine.weight_version() == 1

        server.calls.clear()
        engine.update_weights(iter(buckets(1)), version=2)  # the group is kept: no second rendezvous
        assert "/init_weight_transfer_engine" not in server.names() and "/get_world_size" not in server.names()
        assert server.vllm_version == "2" and server.order.served == 2
        assert torch.equal(server.received[-1][1], buckets(1)[1][0][1])
    finally:
        engine.shutdown()


def test_a_stale_version_a_non_finite_tensor_and_an_unconfigured_server_are_refused_before_their_bytes(fake_vllm):
    server = fake_vllm()
    engine = VllmEngine(server.url, weight_transport="gloo")
    try:
        engine.update_weights(iter(buckets(0)), version=3)
        server.calls.clear()
        with pytest.raises(transfer.WeightTransferRefused, match="version 3 is not newer"):
            engine.update_weights(iter(buckets(1)), version=3)
        assert server.names() == ["stacx_weight_version"]

        server.calls.clear()
        received = len(server.received)
        poisoned = buckets(1)
        poisoned[1][0][1][2] = float("nan")
        with pytest.raises(transfer.WeightTransferRefused, match="'model.norm.weight' holds 1 NaN"):
            engine.update_weights(iter(poisoned), version=4)
        # the first bucket went; the poisoned one did not, and the update was closed without a new version
        assert server.names()[-2:] == ["/update_weights", "/finish_weight_update"]
        assert len(server.received) == received + 2 and not server.active
        assert server.order.served == 3 and server.vllm_version == "3"
        engine.update_weights(iter(buckets(2)), version=4)  # the server takes the next push
        assert server.order.served == 4
    finally:
        engine.shutdown()

    plain = fake_vllm(backend=None)
    engine = VllmEngine(plain.url, weight_transport="gloo")
    try:
        with pytest.raises(transfer.WeightTransferRefused,
                           match=r"--vllm-weight-transfer gloo: .* no weight-transfer backend; start it with "
                                 r"--weight-transfer-config '\{\"backend\": \"stacx_gloo\"\}'"):
            engine.update_weights(iter(buckets(0)), version=1)
        assert "/init_weight_transfer_engine" not in plain.names()
    finally:
        engine.shutdown()


def test_the_nccl_payload_is_vllms_unique_id_form_and_a_cpu_rank_is_refused_naming_the_flag(fake_vllm):
    assert not torch.cuda.is_available()
    with pytest.raises(RuntimeError, match="--vllm-weight-transfer nccl .*on CPU use --vllm-weight-transfer gloo.*"
                                           "NCCL needs a CUDA device on the sending trainer rank"):
        VllmEngine("http://127.0.0.1:1", weight_transport="nccl")

    class RecordingGroup:  # stands in for NcclUniqueIdGroup: what would go over NCCL, in order
        unique_id_b64 = base64.b64encode(bytes(range(NCCL_UNIQUE_ID_BYTES))).decode()

        def __init__(self, *, rendezvous_host, world_size):
            self.world_size, self.sent, self.joined = world_size, [], False

        def join(self):
            self.joined = True

        def broadcast(self, tensor):
            assert self.joined
            self.sent.append(tensor)

        def close(self):
            pass

    server = fake_vllm(backend="nccl", joins=None)
    nccl = transfer.TRANSFER_BACKENDS["nccl"]
    backend = transfer.TransferBackend(name="nccl", server_backend="nccl", open_group=RecordingGroup,
                                       init_info=nccl.init_info)
    from stacx.wire.http_client import HttpTransport

    session = transfer.WeightTransferSession(HttpTransport(server.url), backend, rendezvous_host="unused")
    try:
        assert session.send(iter(buckets(0)), version=1) == 3
        init_info = server.calls[1][1]["init_info"]
        assert init_info == {"rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": RecordingGroup.unique_id_b64,
                             "packed": False}
        assert [t.shape for t in session.group.sent] == [torch.Size([6, 4]), torch.Size([4, 4]), torch.Size([4])]
        assert server.names()[-2:] == ["/finish_weight_update", "/update_weight_version"]
    finally:
        session.close()
    assert vllm_server_command("py", "ckpt", port=1, weight_transfer="nccl")[-2:] == [
        "--weight-transfer-config", '{"backend": "nccl"}']
    assert vllm_server_command("py", "ckpt", port=1, weight_transfer="gloo")[-1] == '{"backend": "stacx_gloo"}'
    assert "--weight-transfer-config" not in vllm_server_command("py", "ckpt", port=1, weight_transfer="shm")


def test_a_server_refusing_the_rendezvous_is_reported_with_its_own_error(fake_vllm, monkeypatch):
    server = fake_vllm(backend="stacx_gloo", joins=None)
    route = server.route

    def refusing(path, body):  # vLLM's answer when the init info does not parse: the worker never joins
        if path == "/init_weight_transfer_engine":
            raise ValueError("Invalid init_info for GlooWeightTransferEngine")
        return route(path, body)

    server.route = refusing
    monkeypatch.setattr(transfer, "GLOO_GROUP_TIMEOUT_S", 2.0)  # the trainer's end stops waiting for the worker
    engine = VllmEngine(server.url, weight_transport="gloo")
    try:
        with pytest.raises(Exception, match="HTTP 500.*Invalid init_info for GlooWeightTransferEngine"):
            engine.update_weights(iter(buckets(0)), version=1)
        assert "/start_weight_update" not in server.names() and server.order.served == 0
    finally:
        engine.shutdown()


def test_the_worker_extension_serves_a_finished_transfers_version_once_and_reports_its_backend():
    extension = worker.StacxWorkerExtension()
    extension.vllm_config = types.SimpleNamespace(weight_transfer_config=types.SimpleNamespace(backend="nccl"))
    # a dense model: nothing for the CPU experts' prepacking to wrap when the backend is asked
    extension.model_runner = types.SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))
    assert extension.stacx_weight_transfer() == {"backend": "nccl"}
    assert extension.stacx_transfer_finished(json.dumps({"version": 2})) == {"weight_version": 2}
    assert extension.stacx_weight_version() == {"weight_version": 2}
    with pytest.raises(worker.BucketRefused, match="not newer"):
        extension.stacx_transfer_finished(json.dumps({"version": 2}))
    with pytest.raises(worker.BucketRefused, match="stacx_transfer_finished: 'version' must be an integer"):
        extension.stacx_transfer_finished(json.dumps({"version": "3"}))
    extension.vllm_config = types.SimpleNamespace(weight_transfer_config=None)
    assert extension.stacx_weight_transfer() == {"backend": None}


def test_only_the_first_tp_pp_cp_dp_rank_sends_and_gets_the_runs_weight_transfer(monkeypatch):
    from stacx.trainer.runtime import role_runtime

    made = []
    monkeypatch.setattr(role_runtime, "engine_client", lambda kind, url, **kwargs: made.append((kind, url, kwargs))
                        or types.SimpleNamespace(update_weights=lambda buckets, version: list(buckets)))
    gathered = []

    def runtime(**ranks):
        groups = types.SimpleNamespace(**{**dict(tp_rank=0, pp_rank=0, cp_rank=0, dp_rank=0, ep_size=1), **ranks})
        return types.SimpleNamespace(groups=groups, _engine_clients={}, lora=None,
                                     weight_buckets=lambda bucket_bytes: iter(gathered.append(ranks) or [[("w", torch.ones(1))]]))

    push = role_runtime.RoleRuntime.push_weights_to_engine
    assert push(runtime(), "vllm", "http://e", 1, 1 << 20, weight_transfer="nccl") == 1
    assert made == [("vllm", "http://e", {"api_key": None, "weight_transfer": "nccl"})]
    for ranks in (dict(tp_rank=1), dict(pp_rank=1), dict(dp_rank=1), dict(cp_rank=1, ep_size=2)):
        assert push(runtime(**ranks), "vllm", "http://e", 1, 1 << 20, weight_transfer="nccl") == 0
    assert len(made) == 1  # the others took part in the gathers (TP, PP, and EP's), and sent nothing
    assert gathered == [{}, dict(tp_rank=1), dict(pp_rank=1), dict(cp_rank=1, ep_size=2)]
    push(runtime(), "cpu", "http://s", 1, 1 << 20)
    assert made[-1] == ("cpu", "http://s", {"api_key": None})


def test_the_flag_reaches_vllm_pushes_only_and_other_kinds_refuse_a_transfer():
    assert FIELD_CHOICES["vllm_weight_transfer"] == VLLM_WEIGHT_TRANSFERS
    section = RolloutSection(vllm_weight_transfer="nccl")
    assert section.weight_transfer_for("vllm") == "nccl" and section.weight_transfer_for("cpu") is None
    assert RolloutSection().weight_transfer_for("vllm") is None
    assert EngineTarget("vllm", ("u",), weight_transfer="gloo").push_options() == {"weight_transfer": "gloo"}
    assert EngineTarget("cpu", ("u",)).push_options() == {}
    client = engine_client("vllm", "http://127.0.0.1:1", weight_transfer="gloo")
    try:
        assert client.transfer_backend.name == "gloo" and client.weight_transport == "shm"
    finally:
        client.shutdown()
    with pytest.raises(ValueError, match="engine kind 'cpu' sends weights one way only"):
        engine_client("cpu", "http://127.0.0.1:1", weight_transfer="gloo")
    with pytest.raises(ValueError, match="--vllm-weight-transfer 'ucx': choose one of"):
        VllmEngine("http://127.0.0.1:1", weight_transport="ucx")


def test_the_preflight_refuses_the_flag_for_another_engine_naming_it():
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.preflight import PreflightError, check_services
    from stacx.trainer.recipes import get_recipe

    run_config = RunConfig(rollout=RolloutSection(rollout_engine="cpu", vllm_weight_transfer="nccl"))
    with pytest.raises(PreflightError, match="--vllm-weight-transfer nccl: only the vllm engine takes it .*"
                                             "--rollout-engine cpu"):
        check_services(run_config, get_recipe("grpo"))
