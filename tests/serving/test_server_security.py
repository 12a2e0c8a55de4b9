"""`stacx serve` attacked: file reads through the shared-memory endpoint, missing or wrong API keys,
half-applied weight buckets, leaked staging files, SGLang bound to every interface."""

import json
import os
import struct
import subprocess
import sys

import pytest
import requests as http
import torch

from stacx.rollout.engines.http import HttpEngine
from stacx.serving.server import MUTATING_ENDPOINTS, EngineHttpServer
from stacx.wire.http_client import RetryPolicy, ServerRequestError
from stacx.wire.weight_transfer import SharedMemoryRegistry
from tests.serving.fixtures import second_checkpoint_buckets

API_KEY = "test-secret-key"


@pytest.fixture(scope="module")
def engine(cpu_engine):
    return cpu_engine


@pytest.fixture(scope="module")
def new_weights(tiny_checkpoints, single_process_world):
    return second_checkpoint_buckets(tiny_checkpoints, single_process_world, bucket_bytes=20_000)


def snapshot(engine):
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def assert_unchanged(engine, before):
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, before[name]), f"parameter {name} changed"


def bucket_body(named, *, version=10 ** 6, final=False, header_overrides=None):
    """The wire body of a bucket, with header fields optionally forged."""
    raw = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    offsets, offset = [], 0
    for r in raw:
        offsets.append(offset)
        offset += r.numel()
    header = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
              "shapes": [list(t.shape) for _, t in named], "offsets": offsets, "num_bytes": offset,
              "version": version, "final": final}
    header.update(header_overrides or {})
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(r.numpy().tobytes() for r in raw)


def auth(key=API_KEY):
    return {"Authorization": f"Bearer {key}"}


# ---- 1. arbitrary file read ------------------------------------------------------------------

def test_shm_endpoint_never_reads_a_path_the_client_names(engine, tmp_path):
    secret = tmp_path / "private"
    secret.write_bytes(torch.arange(64, dtype=torch.float32).numpy().tobytes())
    os.chmod(secret, 0o600)
    name = "model.norm.weight"
    hidden = engine.model.decoder.final_layernorm.weight.numel()
    forged = {"names": [name], "dtypes": ["float32"], "shapes": [[hidden]], "offsets": [0],
              "num_bytes": hidden * 4, "version": 7, "final": True}
    before = snapshot(engine)
    with EngineHttpServer(engine) as server:
        url, key = f"{server.url}/stacx/update_weights_from_shm", auth(server.api_key)
        reply = http.post(url, json={**forged, "path": str(secret)}, headers=key, timeout=10)
        assert reply.status_code == 400 and "'path' is not accepted" in reply.json()["error"]
        for staging_id in ("made-up", str(secret), None, 3):
            reply = http.post(url, json={**forged, "staging_id": staging_id}, headers=key, timeout=10)
            assert reply.status_code == 400 and "staging_id" in reply.json()["error"]
        # a staging file of this server, swapped for a link to the secret after the handshake
        staging = http.post(f"{server.url}/stacx/shm_staging", json={}, headers=key, timeout=10).json()
        assert os.path.dirname(staging["path"]) == server.shm_registry.directory
        assert os.path.basename(staging["path"]).startswith(server.shm_registry.prefix)
        assert (os.stat(staging["path"]).st_mode & 0o777) == 0o600
        os.unlink(staging["path"])
        os.symlink(secret, staging["path"])
        reply = http.post(url, json={**forged, "staging_id": staging["staging_id"]}, headers=key, timeout=10)
        assert reply.status_code == 400 and "replaced" in reply.json()["error"]
        assert engine.weight_version() != 7
    assert_unchanged(engine, before)
    assert not os.path.lexists(staging["path"])  # the server removed its (swapped) name on stop
    assert secret.exists()


def test_registry_prefix_is_private_per_server(tmp_path):
    a, b = SharedMemoryRegistry(str(tmp_path)), SharedMemoryRegistry(str(tmp_path))
    id_a, path_a = a.create()
    assert a.prefix != b.prefix
    with pytest.raises(ValueError, match="not a staging file of this server"):
        b.read({"staging_id": id_a}, where="test")
    a.close()
    a.close()  # twice is harmless
    assert not os.path.exists(path_a)


# ---- 2. authentication -----------------------------------------------------------------------

def test_mutating_endpoints_need_the_api_key(engine, monkeypatch):
    import hmac

    from stacx.serving import http_guard

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(http_guard.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    with EngineHttpServer(engine, api_key=API_KEY) as server:
        for endpoint in sorted(MUTATING_ENDPOINTS):
            missing = http.post(server.url + endpoint, json={}, timeout=10)
            assert missing.status_code == 401, endpoint
            assert "Authorization: Bearer" in missing.json()["error"]
            for wrong in (auth("wrong"), auth(API_KEY + "x"), {"Authorization": API_KEY}, auth("")):
                assert http.post(server.url + endpoint, json={}, headers=wrong, timeout=10).status_code == 403, endpoint
        assert http.get(server.url + "/flush_cache", timeout=10).status_code == 401
        assert compared and all(b == API_KEY.encode() for _, b in compared)
        # nothing was paused by the refused calls; generation and reads stay open
        answer = http.post(server.url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}},
                           timeout=60)
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
        assert http.get(server.url + "/get_weight_version", timeout=10).json() == {"weight_version": "0"}
        assert http.post(server.url + "/pause_generation", json={}, headers=auth(), timeout=10).status_code == 200
        assert http.post(server.url + "/continue_generation", json={}, headers=auth(), timeout=10).status_code == 200
        # a client without the key is told at once (4xx, no retries)
        client = HttpEngine(server.url, RetryPolicy(timeout_s=10, max_attempts=3, backoff_s=0.01), api_key="wrong")
        with pytest.raises(ServerRequestError, match="HTTP 403"):
            client.pause()
        client.shutdown()


@pytest.mark.slow
def test_keyed_client_updates_weights_over_shm_and_http(engine, new_weights, monkeypatch):
    monkeypatch.delenv("STACX_API_KEY", raising=False)
    before = snapshot(engine)
    with EngineHttpServer(engine, api_key=API_KEY) as server:
        shm_client = HttpEngine(server.url, api_key=API_KEY)
        shm_client.update_weights(iter(new_weights), version=3)
        assert shm_client.weight_transport == "shm" and engine.weight_version() == 3
        staging_path = shm_client._staging.path
        assert server.shm_registry.paths == [staging_path] and os.path.exists(staging_path)
        shm_client.close()
        shm_client.close()  # twice is harmless
        assert not os.path.exists(staging_path) and server.shm_registry.paths == []

        monkeypatch.setenv("STACX_API_KEY", API_KEY)  # the environment supplies the key
        body_client = HttpEngine(server.url, weight_transport="http")
        body_client.update_weights(iter(new_weights), version=4)
        assert engine.weight_version() == 4
        body_client.shutdown()
    changed = [name for name, p in engine.model.named_parameters() if not torch.equal(p, before[name])]
    assert changed, "the update did not reach the model"


def test_server_stop_removes_every_staging_file(engine):
    server = EngineHttpServer(engine, api_key=API_KEY).start()
    paths = [http.post(f"{server.url}/stacx/shm_staging", json={}, headers=auth(), timeout=10).json()["path"]
             for _ in range(3)]
    assert all(os.path.exists(p) for p in paths)
    server.stop()
    server.stop()
    assert not any(os.path.exists(p) for p in paths)


# ---- atomic weight updates -------------------------------------------------------------------

def test_rejected_bucket_writes_nothing(engine, new_weights):
    valid = [(n, t) for n, t in new_weights[0] if n.endswith("norm.weight")][:1] or new_weights[0][:1]
    name, tensor = valid[0]
    before = snapshot(engine)
    with pytest.raises(ValueError, match="not a parameter"):
        engine.load_weights(valid + [("model.layers.99.bogus.weight", tensor)])
    other_name = new_weights[-1][-1][0]
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights(valid + [(other_name, tensor.reshape(-1)[:1])])
    with pytest.raises(ValueError, match="appears twice"):
        engine.load_weights(valid + valid)
    assert_unchanged(engine, before)
    version = engine.weight_version()
    with EngineHttpServer(engine) as server:
        url = f"{server.url}/stacx/update_weights_bucket"
        forged_bodies = {
            "not a parameter": bucket_body(valid + [("model.layers.99.bogus.weight", tensor)]),
            "field 'dtype' is 'float128'": bucket_body(valid, header_overrides={"dtypes": ["float128"]}),
            "one entry per tensor": bucket_body(valid, header_overrides={"shapes": []}),
            "are not inside the": bucket_body(valid, header_overrides={"shapes": [[10 ** 6]]}),
            "is not a multiple of the": bucket_body(valid, header_overrides={"offsets": [1]}),
            "num_bytes": bucket_body(valid, header_overrides={"num_bytes": 10 ** 9}),
            "'final'": bucket_body(valid, header_overrides={"final": "yes"}),
            "'version'": bucket_body(valid, final=True, header_overrides={"version": "3"}),
            "header length": struct.pack("<Q", 10 ** 12) + b"{}",
            "not JSON": struct.pack("<Q", 3) + b"{x}",
            "JSON object": struct.pack("<Q", 2) + b"[]",
        }
        for expected, body in forged_bodies.items():
            reply = http.post(url, data=body, headers=auth(server.api_key), timeout=10)
            assert reply.status_code == 400, (expected, reply.text)
            assert expected in reply.json()["error"], (expected, reply.json())
    assert_unchanged(engine, before)
    assert engine.weight_version() == version


# ---- SGLang servers --------------------------------------------------------------------------

def test_sglang_servers_bind_the_node_address_with_the_api_key():
    from stacx.rollout.engines.sglang import SglangServerSpec, build_launch_command, node_address

    command = build_launch_command(SglangServerSpec(model_path="/m", port=31000, api_key="k"))
    assert command[command.index("--host") + 1] == node_address() == "127.0.0.1"  # no Ray here
    assert command[command.index("--api-key") + 1] == "k"
    assert "0.0.0.0" not in command
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="SglangServerSpec.host .* every interface"):
            SglangServerSpec(model_path="/m", port=1, host=wildcard)
    with pytest.raises(ValueError, match="extra_args"):
        SglangServerSpec(model_path="/m", port=1, extra_args=("--host", "0.0.0.0"))


# ---- stacx serve refuses to start open on a network ------------------------------------------

def test_serve_refuses_non_loopback_host_without_api_key(tmp_path, monkeypatch):
    # `stacx serve`'s entry point in this process: the refusal comes before any model is loaded or port bound
    # (an empty folder stands for the checkpoint), so a process of its own would only add its imports.
    from stacx.launch.cli import main

    monkeypatch.delenv("STACX_API_KEY", raising=False)
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--hf-checkpoint", str(tmp_path), "--host", "0.0.0.0", "--port", "0"])
    message = str(refused.value.code)  # a string code: Python prints it to stderr and exits 1
    assert not isinstance(refused.value.code, int)
    assert "--api-key" in message and "--host 0.0.0.0" in message


def test_resolve_api_key_rules(monkeypatch):
    from argparse import Namespace

    from stacx.launch.commands.serve import is_loopback_host, resolve_api_key

    monkeypatch.delenv("STACX_API_KEY", raising=False)
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "::", "10.0.0.2", "example.com"))
    assert resolve_api_key(Namespace(api_key=None, host="127.0.0.1")) is None
    with pytest.raises(SystemExit, match="--api-key"):
        resolve_api_key(Namespace(api_key=None, host="10.0.0.2"))
    with pytest.raises(SystemExit, match="--api-key is empty"):
        resolve_api_key(Namespace(api_key="", host="10.0.0.2"))
    assert resolve_api_key(Namespace(api_key="k", host="10.0.0.2")) == "k"
    monkeypatch.setenv("STACX_API_KEY", "from-env")
    assert resolve_api_key(Namespace(api_key=None, host="10.0.0.2")) == "from-env"


# ---- servers the trainer starts --------------------------------------------------------------

@pytest.mark.slow
def test_trainer_started_server_takes_its_secret_from_the_environment_and_cleans_up_on_sigterm(tiny_checkpoints,
                                                                                             warm_engine_servers):
    import secrets

    from stacx.rollout.engines.launchers import CpuServerProcess
    from stacx.rollout.engines.registry import engine_client

    key = secrets.token_urlsafe(32)
    server = CpuServerProcess(tiny_checkpoints[0], api_key=key)
    try:
        with open(f"/proc/{server.process.pid}/cmdline", "rb") as handle:
            assert key.encode() not in handle.read()  # never on the command line
        assert http.post(server.url + "/pause_generation", json={}, timeout=10).status_code == 401
        assert http.post(server.url + "/pause_generation", json={}, headers=auth("x"), timeout=10).status_code == 403
        client = engine_client("cpu", server.url, api_key=key)
        client.pause()
        client.resume()
        staging = http.post(server.url + "/stacx/shm_staging", json={}, headers=auth(key), timeout=10).json()
        assert os.path.exists(staging["path"])
        client.shutdown()
    finally:
        server.stop()  # SIGTERM: the server removes its staging files on the way out
    assert server.process.returncode == 0
    assert not os.path.exists(staging["path"])


def test_a_stopped_server_exits_without_the_interpreters_teardown():
    # What `stacx serve` does once stopped: its exit handlers run and its output is flushed, but the teardown of
    # torch's and megatron-core's objects (3-6 s before the process was gone on a busy machine) is skipped.
    program = ("import atexit, sys\n"
               "from stacx.launch.commands.serve import exit_without_teardown\n"
               "class Teardown:\n"
               "    def __del__(self):\n"
               "        print('torn down', flush=True)\n"
               "kept = Teardown()  # freed only by the interpreter's teardown\n"
               "atexit.register(lambda: print('exit handler ran'))\n"
               "sys.stdout.write('unflushed ')\n"
               "exit_without_teardown(3)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["unflushed", "exit", "handler", "ran"], done.stdout


def test_a_client_without_the_key_is_refused_not_silently_downgraded(engine, new_weights, monkeypatch):
    monkeypatch.delenv("STACX_API_KEY", raising=False)
    with EngineHttpServer(engine, api_key=API_KEY) as server:
        client = HttpEngine(server.url, RetryPolicy(timeout_s=10, max_attempts=1))
        with pytest.raises(ServerRequestError, match="HTTP 401") as caught:
            client.update_weights(iter(new_weights), version=9)
        assert caught.value.status_code == 401 and client.weight_transport == "shm"
        assert server.shm_registry.paths == [] and engine.weight_version() != 9
        client.shutdown()


@pytest.mark.slow
def test_serve_stops_and_removes_its_files_when_its_parent_is_killed(tiny_checkpoints, tmp_path):
    import time

    # a stand-in driver that starts `stacx serve --parent-pid <its own pid>`, as CpuServerProcess does
    driver_script = (
        "import os, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-m', 'stacx', 'serve', '--hf-checkpoint', sys.argv[1], '--port', '0',"
        " '--api-key-file', sys.argv[2], '--parent-pid', str(os.getpid())]).wait()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "STACX_API_KEY"}
    key_file = tmp_path / "serve.key"
    driver = subprocess.Popen([sys.executable, "-c", driver_script, tiny_checkpoints[0], str(key_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = None
    try:
        for line in driver.stdout:
            if "(ready)" in line:
                url = line.split(" at ", 1)[1].split(" ", 1)[0]
                break
        assert url is not None, "stacx serve did not start"
        assert (os.stat(key_file).st_mode & 0o777) == 0o600  # the generated key, private to the user
        staging = http.post(url + "/stacx/shm_staging", json={}, headers=auth(key_file.read_text().strip()),
                            timeout=10).json()
        assert os.path.exists(staging["path"])
        driver.kill()  # SIGKILL: the driver runs no teardown at all
        driver.wait(timeout=10)
        deadline = time.monotonic() + 60
        while os.path.exists(staging["path"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(staging["path"]), "the orphaned server kept its staging file"
        deadline = time.monotonic() + 30
        while key_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not key_file.exists(), "the orphaned server kept its generated key file"
        with pytest.raises(http.ConnectionError):
            for _ in range(100):  # the socket closes right after the files are removed
                http.get(url + "/health", timeout=2)
                time.sleep(0.1)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)


def test_the_shm_transport_is_chosen_only_for_loopback_servers():
    from stacx.rollout.engines.http import HttpEngine

    assert HttpEngine("http://127.0.0.2:30000").weight_transport == "shm"  # all of 127.0.0.0/8 is this machine
    assert HttpEngine("http://10.0.0.2:30000").weight_transport == "http"
