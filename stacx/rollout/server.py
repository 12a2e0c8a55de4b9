"""A small HTTP server exposing an in-process engine through SGLang's native API subset.

Built on the standard library's `ThreadingHTTPServer`: the endpoints are few, requests are
JSON or one binary body, and it adds no dependency or event loop to the trainer's processes.
(One thread per connection is plenty for a CPU engine that serializes model calls anyway.)

Endpoints (SGLang's names unless marked stacx):
  GET  /health, /health_generate        200 when the engine can serve
  GET  /get_model_info                   {"model_path", "weight_version", "is_generation"}
  GET  /get_weight_version               {"weight_version"}
  POST /generate                         SGLang request fields -> SGLang answers (see sglang_protocol)
  POST /pause_generation                 new /generate requests wait until /continue_generation
  POST /continue_generation
  POST /flush_cache
  POST /stacx/update_weights_bucket      (stacx) one flattened bucket in the body, see weight_transfer.py
  POST /stacx/update_weights_from_shm    (stacx) same-host: bucket metadata + a shared-memory file path
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stacx.rollout.http_engine import BUCKET_ENDPOINT, SHM_BUCKET_ENDPOINT
from stacx.rollout.sglang_protocol import parse_generate_payload, render_generate_item
from stacx.rollout.weight_transfer import SharedMemoryReader, decode_bucket_body, unflatten_bucket

logger = logging.getLogger(__name__)


class PauseGate:
    """Generation waits at the gate while paused."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()

    def pause(self):
        self._open.clear()

    def resume(self):
        self._open.set()

    def wait(self, timeout_s: float) -> bool:
        return self._open.wait(timeout_s)


class EngineHttpServer:
    """Serves `engine` (a CpuEngine or anything with generate / load_weights / set_weight_version).

    Use as a context manager or call `start()` / `stop()`; port 0 picks a free port.
    """

    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 0, model_path: str = "", pause_timeout_s: float = 600.0):
        self.engine = engine
        self.model_path = model_path
        self.gate = PauseGate()
        self.shm_reader = SharedMemoryReader()
        self.pause_timeout_s = pause_timeout_s
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"http://{host}:{self.port}"

    def start(self) -> "EngineHttpServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="stacx-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        """Stop serving and release the socket. Safe before `start()`: `shutdown()` waits for a
        running `serve_forever` loop and would block forever when none was started."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def close(self) -> None:
        """Release the socket after `serve_forever` returned (the foreground `stacx serve` path)."""
        self._httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _make_handler(server: EngineHttpServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body are separate writes; with Nagle on, keep-alive clients stall ~40 ms per reply
        disable_nagle_algorithm = True

        def log_message(self, fmt, *args):  # route access logs to logging, not stderr
            logger.debug("%s - %s", self.address_string(), fmt % args)

        def _send_json(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _read_body(self) -> bytearray:
            length = int(self.headers.get("Content-Length") or 0)
            buffer = bytearray(length)
            view, read = memoryview(buffer), 0
            while read < length:
                n = self.rfile.readinto(view[read:])
                if not n:
                    raise ValueError(f"request body ended after {read} of {length} bytes")
                read += n
            return buffer

        def do_GET(self):
            self._dispatch(self._get_routes())

        def do_POST(self):
            self._dispatch(self._post_routes())

        def _get_routes(self):
            return {
                "/health": self._health, "/health_generate": self._health,
                "/get_model_info": self._model_info, "/get_weight_version": self._weight_version,
                "/flush_cache": self._flush_cache,
            }

        def _post_routes(self):
            return {
                "/generate": self._generate, "/pause_generation": self._pause,
                "/continue_generation": self._continue, "/flush_cache": self._flush_cache,
                BUCKET_ENDPOINT: self._update_bucket, SHM_BUCKET_ENDPOINT: self._update_from_shm,
                "/get_model_info": self._model_info,
            }

        def _dispatch(self, routes):
            path = self.path.split("?", 1)[0]
            handler = routes.get(path)
            if handler is None:
                self._read_body()
                self._send_json(404, {"error": f"unknown endpoint {self.command} {path}; known: {sorted(routes)}"})
                return
            try:
                status, body = handler()
            except ValueError as err:  # the caller's mistake
                status, body = 400, {"error": str(err)}
            except Exception as err:  # an engine failure: the client may retry
                logger.exception("%s %s failed", self.command, path)
                status, body = 500, {"error": f"{type(err).__name__}: {err}"}
            self._send_json(status, body)

        def _json_body(self):
            raw = self._read_body()
            if not raw:
                return {}
            try:
                return json.loads(raw)
            except json.JSONDecodeError as err:
                raise ValueError(f"request body is not JSON: {err}") from err

        def _health(self):
            self._read_body()
            return 200, {"status": "ok"}

        def _model_info(self):
            self._read_body()
            return 200, {"model_path": server.model_path, "is_generation": True,
                         "weight_version": str(server.engine.weight_version())}

        def _weight_version(self):
            return 200, {"weight_version": str(server.engine.weight_version())}

        def _generate(self):
            requests, is_batch = parse_generate_payload(self._json_body())
            if not server.gate.wait(server.pause_timeout_s):
                return 503, {"error": "generation is paused"}
            outputs = server.engine.generate(requests)
            items = [render_generate_item(o, r, uuid.uuid4().hex) for o, r in zip(outputs, requests)]
            return 200, items if is_batch else items[0]

        def _pause(self):
            self._read_body()
            server.gate.pause()
            return 200, {"success": True, "message": "Generation paused successfully."}

        def _continue(self):
            self._read_body()
            server.gate.resume()
            return 200, {"success": True, "message": "Generation continued successfully."}

        def _flush_cache(self):
            self._read_body()
            server.engine.flush_cache()
            return 200, {"success": True}

        def _update_bucket(self):
            body = self._read_body()
            flat, header = decode_bucket_body(body)
            _require_fields(header, ("final", "version"), "/stacx/update_weights_bucket")
            server.engine.load_weights(unflatten_bucket(flat))
            if header["final"]:
                server.engine.set_weight_version(int(header["version"]))
            return 200, {"success": True, "message": f"loaded {len(flat.names)} tensors",
                         "weight_version": str(server.engine.weight_version())}

        def _update_from_shm(self):
            header = self._json_body()
            _require_fields(header, ("final", "version"), "/stacx/update_weights_from_shm")
            flat = server.shm_reader.read(header)
            server.engine.load_weights(unflatten_bucket(flat))
            if header["final"]:
                server.engine.set_weight_version(int(header["version"]))
            return 200, {"success": True, "message": f"loaded {len(flat.names)} tensors",
                         "weight_version": str(server.engine.weight_version())}

    return Handler


def _require_fields(header: dict, names: tuple[str, ...], endpoint: str) -> None:
    """A weight-update request lacking a field is the caller's mistake (400 naming it), not a 500."""
    missing = [name for name in names if name not in header]
    if missing:
        raise ValueError(f"{endpoint}: request is missing field(s) {missing}")
