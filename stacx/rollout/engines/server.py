"""A small HTTP server exposing an in-process engine through SGLang's native API subset.

Built on the standard library's `ThreadingHTTPServer` (docs/dependencies.md says why not
FastAPI/uvicorn): the endpoints are few, requests are JSON or one binary body, and it adds no
dependency or event loop to the trainer's processes. The hardening a maintained stack would give
is here, each limit in `ServerLimits`:

- a body larger than `max_body_bytes` (`max_weight_body_bytes` for a weight bucket) is answered
  413 from its Content-Length, before anything is allocated; JSON bodies are read in chunks
  within `read_timeout_s`, so memory follows the bytes that really arrived;
- every socket read waits at most `read_timeout_s` (slow or idle clients release their thread),
  and at most `max_connections` connections are served at once (more get 503 at once);
- at most `max_queued_requests` `/generate` calls wait for the engine (more get 503, which
  Stacx's client retries with backoff); a call whose client disconnected stops generating;
- a client's mistake is a 400 naming the field (sglang_protocol validates every field);
- `/health` answers 503 when the engine has made no progress for `stall_timeout_s`.

Authentication: with an `api_key`, every mutating endpoint (weight updates, the shared-memory
handshake, pause, continue, flush) needs `Authorization: Bearer <key>` (401 when missing, 403
when wrong, compared with `hmac.compare_digest`). Generation and the read-only endpoints stay open.

Endpoints (SGLang's names unless marked stacx):
  GET  /health, /health_generate        200 when the engine can serve, 503 when it is wedged
  GET  /get_model_info                   {"model_path", "weight_version", "is_generation"}
  GET  /get_weight_version               {"weight_version"}
  POST /generate                         SGLang request fields -> SGLang answers (see sglang_protocol)
  POST /pause_generation                 new /generate requests wait until /continue_generation
  POST /continue_generation
  POST /flush_cache
  POST /stacx/update_weights_bucket      (stacx) one flattened bucket in the body, see weight_transfer.py
  POST /stacx/shm_staging                (stacx) same-host handshake: {} -> {"staging_id", "path"} of a
                                         file this server created in its own shared-memory prefix
  POST /stacx/update_weights_from_shm    (stacx) bucket metadata + the `staging_id` (never a path)
  POST /stacx/shm_staging/release        (stacx) {"staging_id"}: remove that staging file
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Optional

from stacx.rollout.engines.cpu import GenerationCancelled
from stacx.rollout.engines.http_guard import BoundedHTTPServer, HttpError, ServerLimits, check_bearer_token
from stacx.rollout.engines.http import BUCKET_ENDPOINT, SHM_BUCKET_ENDPOINT, SHM_RELEASE_ENDPOINT, SHM_STAGING_ENDPOINT
from stacx.rollout.engines.sglang_protocol import parse_generate_payload, render_generate_item
from stacx.rollout.request_batching import GenerateBatcher
from stacx.rollout.weight_transfer import SharedMemoryRegistry, decode_bucket_body, unflatten_bucket

logger = logging.getLogger(__name__)

MUTATING_ENDPOINTS = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache",
    BUCKET_ENDPOINT, SHM_BUCKET_ENDPOINT, SHM_STAGING_ENDPOINT, SHM_RELEASE_ENDPOINT,
})
"""Endpoints that change the server's state; with an api_key they need the bearer token."""

_READ_CHUNK_BYTES = 1 << 20


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
    api_key: the shared secret every mutating endpoint requires (None: no authentication; only
    sensible on a loopback address, which `stacx serve` enforces).
    tokenizer: encodes `/generate`'s `text` prompts and decodes each answer's `text` (None: token
    ids only, `text` refused, answers carry "").
    """

    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 0, model_path: str = "",
                 pause_timeout_s: float = 600.0, api_key: Optional[str] = None,
                 limits: ServerLimits = ServerLimits(), tokenizer=None):
        if api_key is not None and not api_key:
            raise ValueError("EngineHttpServer: api_key is empty; pass None for no authentication")
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.gate = PauseGate()
        self.shm_registry = SharedMemoryRegistry()
        self.pause_timeout_s = pause_timeout_s
        self.api_key = api_key
        self.limits = limits
        self._admitted = 0
        self._admitted_lock = threading.Lock()
        # Concurrent /generate calls run as one engine batch (stacx.rollout.request_batching).
        self.batcher = GenerateBatcher(engine) if engine is not None else None
        self._httpd = BoundedHTTPServer((host, port), _make_handler(self), max_connections=limits.max_connections)
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
        """Stop serving, release the socket and remove the shared-memory staging files. Safe before
        `start()` (`shutdown()` waits for a running `serve_forever` loop and would block forever when
        none was started) and safe to call twice."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.close()

    def close(self) -> None:
        """Release the socket and remove the staging files after `serve_forever` returned (the
        foreground `stacx serve` path). Safe to call twice."""
        try:
            self._httpd.server_close()
        finally:
            self.shm_registry.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- admission and health ----------------------------------------------------------------

    def admit_generate(self) -> None:
        """Count one more `/generate` call in, or raise 503 when `max_queued_requests` are admitted."""
        with self._admitted_lock:
            if self._admitted >= self.limits.max_queued_requests:
                raise HttpError(503, f"/generate queue is full ({self._admitted} requests admitted, "
                                     f"max_queued_requests {self.limits.max_queued_requests}); retry later")
            self._admitted += 1

    def release_generate(self) -> None:
        with self._admitted_lock:
            self._admitted -= 1

    def health_report(self) -> tuple[int, dict]:
        """(200, ok) when the engine can serve; (503, why) when it reports unhealthy or wedged."""
        stalled_for = getattr(self.engine, "stalled_for_s", None)
        stalled_s = stalled_for() if stalled_for is not None else 0.0
        if stalled_s > self.limits.stall_timeout_s:
            return 503, {"status": "wedged", "error": f"the engine made no progress for {stalled_s:.0f}s "
                                                      f"(stall_timeout_s {self.limits.stall_timeout_s:.0f})"}
        health = getattr(self.engine, "health", None)
        if health is not None and not health():
            return 503, {"status": "unhealthy", "error": "the engine reports it cannot serve"}
        return 200, {"status": "ok"}

    def check_authorization(self, header: Optional[str]) -> Optional[tuple[int, str]]:
        """None when allowed; else (401 or 403, message), see `check_bearer_token`."""
        return check_bearer_token(self.api_key, header)


def _make_handler(server: EngineHttpServer):
    limits = server.limits

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body are separate writes; with Nagle on, keep-alive clients stall ~40 ms per reply
        disable_nagle_algorithm = True
        timeout = limits.read_timeout_s  # every socket read and write, idle keep-alive included

        def log_message(self, fmt, *args):  # route access logs to logging, not stderr
            logger.debug("%s - %s", self.address_string(), fmt % args)

        def _send_json(self, status: int, body, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        # ---- bodies --------------------------------------------------------------------------

        def _content_length(self, limit: int) -> int:
            if self.headers.get("Transfer-Encoding"):
                raise HttpError(411, "chunked request bodies are not supported; send Content-Length", close=True)
            raw = self.headers.get("Content-Length")
            if raw is None:
                return 0
            try:
                length = int(raw)
            except ValueError:
                raise HttpError(400, f"Content-Length {raw[:40]!r} is not an integer", close=True) from None
            if length < 0:
                raise HttpError(400, f"Content-Length {length} is negative", close=True)
            if length > limit:
                raise HttpError(413, f"request body of {length} bytes exceeds the server's limit of {limit} bytes",
                                close=True)
            return length

        def _read_json_bytes(self) -> bytes:
            """The body in chunks, all of it within read_timeout_s (memory follows what arrived)."""
            length = self._content_length(limits.max_body_bytes)
            deadline = time.monotonic() + limits.read_timeout_s
            chunks, read = [], 0
            while read < length:
                if time.monotonic() > deadline:
                    raise HttpError(408, f"request body not received within {limits.read_timeout_s:.0f}s", close=True)
                try:
                    chunk = self.rfile.read1(min(_READ_CHUNK_BYTES, length - read))
                except TimeoutError:
                    raise HttpError(408, f"request body stalled for {limits.read_timeout_s:.0f}s after {read} of "
                                         f"{length} bytes", close=True) from None
                if not chunk:
                    raise HttpError(400, f"request body ended after {read} of {length} bytes", close=True)
                chunks.append(chunk)
                read += len(chunk)
            return b"".join(chunks)

        def _read_weight_body(self) -> bytearray:
            """The (authenticated) binary body in one buffer, received in place."""
            length = self._content_length(limits.max_weight_body_bytes)
            buffer = bytearray(length)
            view, read = memoryview(buffer), 0
            while read < length:
                try:
                    n = self.rfile.readinto(view[read:])
                except TimeoutError:
                    raise HttpError(408, f"request body stalled for {limits.read_timeout_s:.0f}s after {read} of "
                                         f"{length} bytes", close=True) from None
                if not n:
                    raise HttpError(400, f"request body ended after {read} of {length} bytes", close=True)
                read += n
            return buffer

        def _discard_body(self) -> None:
            """Skip a small body we will not use (keeps the connection usable), else close it."""
            try:
                self._read_json_bytes()
            except HttpError:
                self.close_connection = True

        def _json_body(self):
            raw = self._read_json_bytes()
            if not raw:
                return {}
            try:
                return json.loads(raw, parse_constant=_reject_json_constant)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"request body is not JSON: {err}") from err

        # ---- routing -------------------------------------------------------------------------

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
                SHM_STAGING_ENDPOINT: self._shm_staging, SHM_RELEASE_ENDPOINT: self._shm_release,
                "/get_model_info": self._model_info,
            }

        def _dispatch(self, routes):
            path = self.path.split("?", 1)[0]
            handler = routes.get(path)
            if handler is None:
                self._discard_body()
                self._send_json(404, {"error": f"unknown endpoint {self.command} {path}; known: {sorted(routes)}"})
                return
            if path in MUTATING_ENDPOINTS:
                refusal = server.check_authorization(self.headers.get("Authorization"))
                if refusal is not None:
                    self._discard_body()
                    status, message = refusal
                    self._send_json(status, {"error": f"{path}: {message}"}, {"WWW-Authenticate": "Bearer"})
                    return
            try:
                status, body = handler()
            except GenerationCancelled:
                logger.info("%s %s: the client disconnected; generation stopped", self.command, path)
                self.close_connection = True
                return
            except HttpError as err:
                self.close_connection = self.close_connection or err.close
                status, body = err.status, {"error": str(err)}
            except ValueError as err:  # the caller's mistake
                status, body = 400, {"error": str(err)}
            except Exception as err:  # an engine failure: the client may retry
                logger.exception("%s %s failed", self.command, path)
                status, body = 500, {"error": f"{type(err).__name__}: {err}"}
            self._send_json(status, body)

        # ---- endpoints -----------------------------------------------------------------------

        def _health(self):
            self._discard_body()
            return server.health_report()

        def _model_info(self):
            self._discard_body()
            return 200, {"model_path": server.model_path, "is_generation": True,
                         "weight_version": str(server.engine.weight_version())}

        def _weight_version(self):
            self._discard_body()
            return 200, {"weight_version": str(server.engine.weight_version())}

        def _client_gone(self) -> bool:
            """True once the client closed its end (a readable socket with nothing to read)."""
            try:
                poller = select.poll()  # unlike select(), no limit on the descriptor number
                poller.register(self.connection, select.POLLIN)
                return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _generate(self):
            requests, is_batch = parse_generate_payload(self._json_body(), server.tokenizer)
            server.admit_generate()
            try:
                if not server.gate.wait(server.pause_timeout_s):
                    return 503, {"error": "generation is paused"}
                if self._client_gone():
                    raise GenerationCancelled()
                outputs = server.batcher.generate(requests, should_stop=self._client_gone)
            finally:
                server.release_generate()
            items = [render_generate_item(o, r, uuid.uuid4().hex, server.tokenizer) for o, r in zip(outputs, requests)]
            return 200, items if is_batch else items[0]

        def _pause(self):
            self._discard_body()
            server.gate.pause()
            return 200, {"success": True, "message": "Generation paused successfully."}

        def _continue(self):
            self._discard_body()
            server.gate.resume()
            return 200, {"success": True, "message": "Generation continued successfully."}

        def _flush_cache(self):
            self._discard_body()
            server.engine.flush_cache()
            return 200, {"success": True}

        def _update_bucket(self):
            body = self._read_weight_body()
            flat, header = decode_bucket_body(body, where=BUCKET_ENDPOINT)
            return _apply_bucket(server.engine, flat, header)

        def _shm_staging(self):
            self._discard_body()
            staging_id, path = server.shm_registry.create()
            return 200, {"staging_id": staging_id, "path": path}

        def _shm_release(self):
            body = self._json_body()
            if not isinstance(body, dict) or not isinstance(body.get("staging_id"), str):
                raise ValueError(f"{SHM_RELEASE_ENDPOINT}: body must be {{\"staging_id\": <string>}}")
            return 200, {"success": server.shm_registry.release(body["staging_id"])}

        def _update_from_shm(self):
            header = self._json_body()
            flat = server.shm_registry.read(header, where=SHM_BUCKET_ENDPOINT)
            return _apply_bucket(server.engine, flat, header)

    return Handler


def _apply_bucket(engine, flat, header: dict) -> tuple[int, dict]:
    """Load one validated bucket (the engine checks every name and shape before writing any)."""
    engine.load_weights(unflatten_bucket(flat))
    if header["final"]:
        engine.set_weight_version(header["version"])
    return 200, {"success": True, "message": f"loaded {len(flat.slots)} tensors",
                 "weight_version": str(engine.weight_version())}


def _reject_json_constant(name: str):
    raise ValueError(f"request body holds {name}, which is not valid JSON; send finite numbers")
