"""`stacx serve` under bad input and load: 400s naming the field, 413 before allocating, read
timeouts, connection and queue caps, generation stopped on disconnect, /health when wedged."""

import json
import socket
import threading
import time
import tracemalloc

import pytest
import requests as http

from stacx.rollout.engines.http import HttpEngine
from stacx.serving.cpu_engine import CpuEngine
from stacx.serving.server import EngineHttpServer, ServerLimits
from stacx.wire.http_client import RetryPolicy, ServerRequestError


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, single_process_world):
    return CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])


def wait_until(predicate, timeout_s=20.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def raw_request(port, head: bytes, timeout_s=10.0) -> bytes:
    """Send raw bytes, return everything the server answers before closing (or the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 4 + _content_length(data):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
        return data


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


BAD_REQUESTS = {
    # name the field -> body
    "input_ids[1]": {"input_ids": [4, None]},
    "input_ids[1]'": {"input_ids": [4, 5.0]},
    "input_ids[1][1]": {"input_ids": [[4, 5], [4, [5]]]},
    "'input_ids'": {"input_ids": []},
    "input_ids hold token ids": {"input_ids": [4, 10 ** 6]},
    "sampling_params.temperature": {"input_ids": [4], "sampling_params": {"temperature": "hot"}},
    "sampling_params.sampling_seed": {"input_ids": [4], "sampling_params": {"sampling_seed": 1.5}},
    "sampling_params.sampling_seed'": {"input_ids": [4], "sampling_params": {"sampling_seed": "3"}},
    "sampling_params.ignore_eos": {"input_ids": [4], "sampling_params": {"ignore_eos": "true"}},
    "sampling_params.max_new_tokens": {"input_ids": [4], "sampling_params": {"max_new_tokens": True}},
    "context length": {"input_ids": [4], "sampling_params": {"max_new_tokens": 10 ** 6}},
    "return_logprob": {"input_ids": [4], "return_logprob": "false"},
    "return_logprob[1]": {"input_ids": [[4], [5]], "return_logprob": [True, "no"]},
    "top_logprobs_num": {"input_ids": [4], "top_logprobs_num": -1},
    "token_ids_logprob hold token ids": {"input_ids": [4], "token_ids_logprob": [10 ** 6]},
    "token_ids_logprob[0]": {"input_ids": [4], "token_ids_logprob": [None]},
    "'sampling_params' must be a JSON object": {"input_ids": [4], "sampling_params": "greedy"},
    "unsupported keys": {"input_ids": [4], "sampling_params": {"temprature": 1.0}},
    "has 1 entries for 2 requests": {"input_ids": [[4], [5]], "sampling_params": [{}]},
    "JSON object": [4, 5],
}


def test_client_errors_are_400_naming_the_field(engine):
    with EngineHttpServer(engine) as server:
        for expected, body in BAD_REQUESTS.items():
            reply = http.post(server.url + "/generate", json=body, timeout=30)
            assert reply.status_code == 400, (expected, reply.status_code, reply.text)
            assert expected.rstrip("'") in reply.json()["error"], (expected, reply.json())
        for raw, expected in ((b'{"input_ids": [4], "sampling_params": {"temperature": NaN}}', "NaN"),
                              (b'{"input_ids": [4], "sampling_params": {"top_p": -Infinity}}', "-Infinity"),
                              (b'{"input_ids": [4], "sampling_params": {"temperature": 1e999}}', "finite"),
                              (b'{"input_ids": [4', "not JSON"), (b"\xff\xfe", "not JSON")):
            reply = http.post(server.url + "/generate", data=raw, timeout=30)
            assert reply.status_code == 400 and expected in reply.json()["error"], (raw, reply.text)
        # the server is still fine, and Stacx's client raises a 4xx at once (no retries)
        ok = http.post(server.url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}},
                       timeout=30)
        assert ok.status_code == 200
        client = HttpEngine(server.url, RetryPolicy(timeout_s=10, max_attempts=5, backoff_s=5))
        started = time.monotonic()
        with pytest.raises(ServerRequestError, match="HTTP 400"):
            client.transport.post_json("/generate", {"input_ids": [4, None]})
        assert time.monotonic() - started < 4  # a retry would have slept 5 s
        client.shutdown()


def test_oversized_body_is_413_before_any_allocation(engine):
    limits = ServerLimits(max_body_bytes=1 << 20, max_weight_body_bytes=2 << 20)
    with EngineHttpServer(engine, limits=limits) as server:
        tracemalloc.start()
        try:
            answer = raw_request(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500000000\r\n\r\n")
            weights = raw_request(server.port, b"POST /stacx/update_weights_bucket HTTP/1.1\r\nHost: x\r\n"
                                               b"Authorization: Bearer %s\r\n"
                                               b"Content-Length: 500000000\r\n\r\n" % server.api_key.encode())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert status_of(answer) == 413 and b"500000000 bytes exceeds" in answer
        assert status_of(weights) == 413
        assert peak < 50_000_000, f"the server allocated {peak} bytes for a body it refused"
        bad_length = raw_request(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n")
        assert status_of(bad_length) == 400 and b"Content-Length" in bad_length
        chunked = raw_request(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert status_of(chunked) == 411


def test_slow_clients_time_out_and_connections_are_capped(engine):
    limits = ServerLimits(read_timeout_s=0.5, max_connections=4)
    with EngineHttpServer(engine, limits=limits) as server:
        slow = []
        for _ in range(4):  # hold every connection slot with half-sent headers
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            slow.append(sock)
        deadline = time.monotonic() + 30  # poll until the server holds all four, not a blind sleep
        while server.connections.open < 4:
            assert time.monotonic() < deadline, "the server never accepted the four slow connections"
            time.sleep(0.01)
        refused = raw_request(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(refused) == 503 and b"maximum of 4 busy connections" in refused
        started = time.monotonic()
        for sock in slow:  # the server drops each after read_timeout_s
            assert sock.recv(65536) == b""
            sock.close()
        assert time.monotonic() - started < 5
        # a body that trickles in is cut off within the timeout too
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            started = time.monotonic()
            data = sock.recv(65536)
            assert data == b"" or status_of(data) in (400, 408)
            assert time.monotonic() - started < 5
        wait_until(lambda: http.get(server.url + "/health", timeout=5).status_code == 200, what="a free slot")


def test_idle_connections_make_room_for_new_clients_at_the_cap(engine):
    """1,100 idle sockets from one process made every other client get 503 for 40-70 s; at the cap the longest-idle
    connection is now closed to admit a new one."""
    limits = ServerLimits(max_connections=16)
    with EngineHttpServer(engine, limits=limits) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(40)]
        try:
            wait_until(lambda: server.connections.evicted_idle >= 24, what="the oldest idle sockets to be closed")
            assert server.connections.open == 16
            with http.Session() as other:
                assert other.get(server.url + "/health", timeout=5).status_code == 200
                assert other.post(server.url + "/generate", json={"input_ids": [4, 5], "sampling_params": {
                    "max_new_tokens": 1}}, timeout=30).status_code == 200
            assert idle[0].recv(1) == b""  # the oldest was closed by the server
        finally:
            for sock in idle:
                sock.close()


def test_queue_is_bounded_and_a_full_queue_is_503(engine):
    limits = ServerLimits(max_queued_requests=2)
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}}
    with EngineHttpServer(engine, limits=limits) as server:
        answers = []
        engine._lock.acquire()  # the engine is busy
        try:
            workers = [threading.Thread(target=lambda: answers.append(http.post(server.url + "/generate", json=body,
                                                                                timeout=60).status_code))
                       for _ in range(2)]
            for worker in workers:
                worker.start()
            wait_until(lambda: server._admitted["shared"] == 2, what="two admitted requests")
            full = http.post(server.url + "/generate", json=body, timeout=10)
            assert full.status_code == 503 and "queue is full" in full.json()["error"]
            # The training run's own calls (the server's key) have their own lane: admitted, never refused for
            # the traffic of agents and other clients.
            trainer = threading.Thread(target=lambda: answers.append(http.post(
                server.url + "/generate", json=body, headers={"Authorization": f"Bearer {server.api_key}"},
                timeout=60).status_code))
            trainer.start()
            wait_until(lambda: server._admitted["trainer"] == 1, what="the trainer's request admitted")
        finally:
            engine._lock.release()
        for worker in [*workers, trainer]:
            worker.join(timeout=60)
        assert answers == [200, 200, 200]
        assert http.post(server.url + "/generate", json=body, timeout=60).status_code == 200


def test_generation_stops_when_its_client_disconnects(engine, monkeypatch):
    steps = []
    real_call = engine._model_call

    def slow_call(forward, *args):
        steps.append(time.monotonic())
        time.sleep(0.02)
        return real_call(forward, *args)

    monkeypatch.setattr(engine, "_model_call", slow_call)
    body = json.dumps({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}).encode()
    with EngineHttpServer(engine) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: len(steps) >= 3, what="generation to start")
        sock.close()
        wait_until(lambda: engine.stalled_for_s() == 0.0 and not engine._lock.locked(), what="generation to stop")
        stopped_at = len(steps)
        assert stopped_at < 100, f"generation ran {stopped_at} of 200 steps after its client left"
        # the engine serves the next request at once
        steps.clear()
        reply = http.post(server.url + "/generate", json={"input_ids": [4], "sampling_params": {"max_new_tokens": 2}},
                          timeout=30)
        assert reply.status_code == 200 and len(steps) == 2  # one forward per generated token


def test_health_reports_a_wedged_engine(engine, monkeypatch):
    release = threading.Event()
    real_call = engine._model_call

    def stuck_call(forward, *args):
        release.wait(30)
        return real_call(forward, *args)

    monkeypatch.setattr(engine, "_model_call", stuck_call)
    limits = ServerLimits(stall_timeout_s=0.3)
    with EngineHttpServer(engine, limits=limits) as server:
        client = HttpEngine(server.url)
        assert client.health()
        worker = threading.Thread(target=lambda: http.post(
            server.url + "/generate", json={"input_ids": [4], "sampling_params": {"max_new_tokens": 1}}, timeout=60))
        worker.start()
        try:
            wait_until(lambda: http.get(server.url + "/health", timeout=5).status_code == 503, what="/health 503")
            reply = http.get(server.url + "/health", timeout=5).json()
            assert reply["status"] == "wedged" and "no progress" in reply["error"]
            assert not client.health()
        finally:
            release.set()
            worker.join(timeout=60)
        wait_until(lambda: http.get(server.url + "/health", timeout=5).status_code == 200, what="/health 200 again")
        client.shutdown()


def test_serve_flags_map_to_limits():
    from argparse import Namespace

    from stacx.launch.commands.serve import build_limits

    args = Namespace(max_body_bytes=10, max_weight_body_bytes=20, read_timeout_s=1.5, keep_alive_timeout_s=2.5,
                     max_connections=3, max_requests_per_client=5, max_queued_requests=4, stall_timeout_s=9.0,
                     max_chars_per_token=7)
    assert build_limits(args) == ServerLimits(max_body_bytes=10, max_weight_body_bytes=20, read_timeout_s=1.5,
                                              keep_alive_timeout_s=2.5, max_connections=3, max_requests_per_client=5,
                                              max_queued_requests=4, stall_timeout_s=9.0, max_chars_per_token=7)
    with pytest.raises(SystemExit, match="--max-queued-requests: .*must be >= 1"):
        build_limits(Namespace(**{**vars(args), "max_queued_requests": 0}))
    with pytest.raises(SystemExit, match="--read-timeout-s"):
        build_limits(Namespace(**{**vars(args), "read_timeout_s": 0}))
    with pytest.raises(SystemExit, match="--max-requests-per-client"):
        build_limits(Namespace(**{**vars(args), "max_requests_per_client": 0}))
