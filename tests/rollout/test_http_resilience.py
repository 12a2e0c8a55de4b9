"""Retries with backoff, immediate 4xx errors, and a teacher server that went away."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stacx.rollout.teacher import TeacherClient, TeacherUnavailableError
from stacx.wire.http_client import HttpTransport, RetryPolicy, ServerRequestError, ServerUnavailableError


class FlakyHandler(BaseHTTPRequestHandler):
    """Fails with 503 `failures` times, then answers; 400 on /bad."""

    protocol_version = "HTTP/1.1"
    calls = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        FlakyHandler.calls.append(time.monotonic())
        status, body = (200, {"ok": True})
        if self.path == "/bad":
            status, body = 400, {"error": "input_ids must be a list"}
        elif len(FlakyHandler.calls) <= self.server.failures:
            status, body = 503, {"error": "warming up"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_retries_with_backoff_then_success_and_4xx_is_immediate():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    server.failures = 2
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        FlakyHandler.calls = []
        transport = HttpTransport(f"http://127.0.0.1:{server.server_address[1]}",
                                  RetryPolicy(timeout_s=5, max_attempts=4, backoff_s=0.1, backoff_max_s=1.0))
        assert transport.post_json("/generate", {}) == {"ok": True}
        gaps = [b - a for a, b in zip(FlakyHandler.calls, FlakyHandler.calls[1:])]
        assert len(FlakyHandler.calls) == 3 and gaps[0] >= 0.1 and gaps[1] >= 0.2  # 0.1 s, then doubled
        FlakyHandler.calls = [0.0] * 10  # past the failures
        with pytest.raises(ServerRequestError, match="rejected /bad .*HTTP 400.*input_ids"):
            transport.post_json("/bad", {}, summary="one request")
        assert len(FlakyHandler.calls) == 11  # no retry
        server.failures = 100
        FlakyHandler.calls = []
        with pytest.raises(ServerUnavailableError, match=r"did not answer /generate after 4 attempts \(request: 2 seqs\).*503"):
            transport.post_json("/generate", {}, summary="2 seqs")
    finally:
        server.shutdown()
        server.server_close()


def test_killed_teacher_server_raises_named_error_after_retry_budget(tiny_checkpoints, single_process_world):
    # `stacx serve`'s server (a frozen teacher) in this process: once it is stopped its port refuses
    # connections, as a killed process's does, which is what the client sees.
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer

    server = EngineHttpServer(CpuEngine.from_hf_checkpoint(tiny_checkpoints[1]), weight_updates=False).start()
    url = server.url
    try:
        retry = RetryPolicy(timeout_s=10, max_attempts=3, backoff_s=0.2)
        teacher = TeacherClient(url, retry=retry)
        (scores,) = teacher.score([[4, 10, 11, 12]], [2])
        assert scores.log_probs.shape == (2,) and bool((scores.log_probs <= 0).all())
        server.stop()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5).close()
        start = time.monotonic()
        with pytest.raises(TeacherUnavailableError) as info:
            teacher.score([[4, 10, 11, 12]], [2])
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert url in message and "/generate" in message and "after 3 attempts" in message
        assert "teacher scoring of 1 trajectories" in message
        assert elapsed >= 0.2 + 0.4  # the backoff budget was spent before giving up
    finally:
        server.stop()
