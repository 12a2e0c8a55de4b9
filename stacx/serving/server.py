"""An HTTP server exposing an in-process engine through SGLang's native API subset (`stacx serve`).

FastAPI on uvicorn, run in-process (docs/dependencies.md says why): one asyncio thread holds every
connection, blocking work (generation, weight loads) runs in worker threads. The limits, each in
`ServerLimits` (stacx.serving.http_guard):

- a body larger than `max_body_bytes` is answered 413 from its Content-Length, before anything is
  allocated; JSON bodies are read within `read_timeout_s`, memory following the bytes that arrived;
- a weight body may be no larger than the model's own parameter bytes plus a header
  (`weight_body_limit`), is read in chunks straight into one buffer of its Content-Length, one
  weight request at a time;
- a connection must send a whole request head within `read_timeout_s`, idle keep-alive
  connections close after `keep_alive_timeout_s`, at most `max_connections` are open (one more
  gets 503 at once) and one client address has at most `max_requests_per_client` requests in
  flight (more get 503); the listen backlog is `LISTEN_BACKLOG`;
- at most `max_queued_requests` `/generate` calls wait for the engine (more get 503, which
  Stacx's client retries with backoff); a call whose client disconnected stops generating;
- a client's mistake is a 400 naming the field (sglang_protocol validates every field);
- weight versions only move forward: a replayed or stale bucket gets 409 (weight_versions.py);
  a bucket holding NaN or infinity gets 400 naming the tensor;
- `/health` answers 503 when the engine has made no progress for `stall_timeout_s`.

Authentication: every mutating endpoint (weight updates, the shared-memory handshake, pause,
continue, abort, flush) needs `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic clients'
header) (401 when missing, 403 when wrong, compared with `hmac.compare_digest`). A server that takes
weight updates always has a key (a random one when none is given, `api_key`); one started with
`weight_updates=False` refuses the weight endpoints, and without a key every mutating endpoint.
Generation and the reads stay open.

Endpoints (SGLang's names unless marked stacx; the schema is at GET /openapi.json):
  GET  /health, /health_generate        200 when the engine can serve, 503 when it is wedged
  GET  /get_model_info                   {"model_path", "weight_version", "is_generation",
                                          "stacx_generate_stream": true}
  GET  /get_weight_version               {"weight_version"}
  POST /generate                         SGLang request fields -> SGLang answers (see sglang_protocol); with
                                         "stream": true the tokens as they come, then the answer (generate_stream)
  POST /pause_generation                 new /generate requests wait until /continue_generation (in-flight
                                         ones finish, or stop at /abort_request)
  POST /continue_generation
  POST /abort_request                    {"rid": id} or {"abort_all": true}: those /generate requests stop
                                         between decoding steps and answer what they generated so far
                                         (finish_reason "abort")
  POST /flush_cache
  POST /stacx/update_weights_bucket      (stacx) one flattened bucket in the body, see weight_transfer.py
  POST /stacx/shm_staging                (stacx) same-host handshake: {} -> {"staging_id", "path"} of a
                                         file this server created in its own shared-memory prefix
  POST /stacx/weight_digests           (stacx) {"names"} -> {"digests": {name: digest}, "dtype"} (post-sync check)
  POST /stacx/update_weights_from_shm    (stacx) bucket metadata + the `staging_id` (never a path)
  POST /stacx/shm_staging/release        (stacx) {"staging_id"}: remove that staging file
  POST [/sessions/ID]/v1/chat/completions, [/sessions/ID]/v1/completions, GET [/sessions/ID]/v1/models
                                         the OpenAI-compatible API (openai_endpoints.py); a turn under
                                         a session is recorded for training; errors on these paths
                                         are in OpenAI's schema (openai_errors.py)
  POST /stacx/sessions/ID                (stacx) open a session for one episode -> its secret (the
                                         session's prefix becomes /sessions/ID/SECRET)
  GET, DELETE /stacx/sessions/ID         (stacx) a session's recorded turns (DELETE: and forget them)
  POST [/sessions/ID]/v1/messages, [/sessions/ID]/v1/messages/count_tokens
                                         Anthropic's Messages API (anthropic_endpoints.py), recorded
                                         like the OpenAI routes
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from typing import Awaitable, Callable, Optional

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stacx.serving.aborts import AbortBook
from stacx.serving.anthropic_endpoints import AnthropicEndpoints
from stacx.serving.generate_stream import stream_asked, stream_generate
from stacx.wire.generate_progress import STREAM_CAPABILITY
from stacx.serving.http_guard import (
    ConnectionCounter,
    HttpError,
    PerClientLimit,
    ServerLimits,
    check_bearer_token,
    guarded_h11_protocol,
    presented_authorization,
)
from stacx.serving.openai_endpoints import OpenAIEndpoints
from stacx.serving.openai_errors import is_openai_path, openai_error_body
from stacx.serving.request_batching import GenerateBatcher
from stacx.serving.request_bodies import check_text_budget, content_length, read_body_into, read_json
from stacx.wire.engine import GenerationCancelled
from stacx.wire.sglang_protocol import parse_abort_payload, parse_generate_payload, render_generate_item
from stacx.wire.weight_transfer import (
    BUCKET_ENDPOINT,
    DIGEST_ENDPOINT,
    SHM_BUCKET_ENDPOINT,
    SHM_RELEASE_ENDPOINT,
    SHM_STAGING_ENDPOINT,
    SharedMemoryRegistry,
    decode_bucket_body,
    max_bucket_body_bytes,
    refuse_non_finite,
    unflatten_bucket,
)
from stacx.wire.weight_versions import StaleWeightsError, WeightVersionGate

__all__ = ["EngineHttpServer", "ServerLimits", "MUTATING_ENDPOINTS", "WEIGHT_ENDPOINTS"]

logger = logging.getLogger(__name__)

WEIGHT_ENDPOINTS = frozenset({BUCKET_ENDPOINT, SHM_BUCKET_ENDPOINT, SHM_STAGING_ENDPOINT, SHM_RELEASE_ENDPOINT})
"""Endpoints that change the served weights; refused by a server started with weight_updates=False."""
MUTATING_ENDPOINTS = WEIGHT_ENDPOINTS | {"/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
                                         DIGEST_ENDPOINT}
"""Endpoints that change the server's state, or read its weights back (the digest endpoint: a full pass over the
weights, which an anonymous client must not be able to demand); they need the bearer token."""
LISTEN_BACKLOG = 2048
"""Connections the kernel queues before the server accepts them (the standard library's 5 reset
5-10 % of requests from 32 parallel clients)."""
START_TIMEOUT_S = 30.0


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


TRAINER_LANE, SHARED_LANE = "trainer", "shared"
"""The two admission lanes of generation calls (`EngineHttpServer.lane_of`)."""
DEFAULT_CONTEXT_FOR_TEXT_BOUND = 32768
"""The context length the text bound assumes for an engine that does not say its own."""


def weight_body_limit(engine, limits: ServerLimits) -> int:
    """The largest weight body this server reads: the model's parameter bytes plus a header
    (`max_bucket_body_bytes`), never more than `limits.max_weight_body_bytes`."""
    size = getattr(engine, "weight_update_size", None)
    if size is None:
        return limits.max_weight_body_bytes
    return min(limits.max_weight_body_bytes, max_bucket_body_bytes(*size()))


class EngineHttpServer:
    """Serves `engine` (a CpuEngine or anything with generate / load_weights / set_weight_version).

    Use as a context manager or call `start()` / `stop()`; port 0 picks a free port (bound here, so
    `url` is known before `start()`).
    api_key: the shared secret every mutating endpoint requires; None: a random one
    (`secrets.token_urlsafe`, read it from `api_key`) when weight_updates, else no key and no
    mutating endpoint at all.
    weight_updates: False refuses the weight endpoints (a teacher, or a frozen model).
    tokenizer: encodes `/generate`'s `text` prompts and decodes each answer's `text` (None: token
    ids only, `text` refused, answers carry "").
    """

    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 0, model_path: str = "",
                 pause_timeout_s: float = 600.0, api_key: Optional[str] = None, weight_updates: bool = True,
                 limits: ServerLimits = ServerLimits(), tokenizer=None):
        if api_key is not None and not api_key:
            raise ValueError("EngineHttpServer: api_key is empty; pass None for a generated one")
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.weight_updates = weight_updates
        self.api_key = api_key if api_key is not None or not weight_updates else secrets.token_urlsafe(32)
        self.gate = PauseGate()
        self.shm_registry = SharedMemoryRegistry()
        self.pause_timeout_s = pause_timeout_s
        self.limits = limits
        self.weight_body_limit = weight_body_limit(engine, limits)
        context = getattr(engine, "context_length", None) or DEFAULT_CONTEXT_FOR_TEXT_BOUND
        self.max_text_chars = limits.max_chars_per_token * context
        """Characters of text one request may carry into the tokenizer (ServerLimits.max_chars_per_token)."""
        self.versions = WeightVersionGate()
        self.connections = ConnectionCounter(limits.max_connections)
        self._admitted = {TRAINER_LANE: 0, SHARED_LANE: 0}
        self._weight_lock = asyncio.Lock()  # one weight body in memory at a time
        self._generate_threads: dict[str, anyio.CapacityLimiter] = {}  # per lane, made on the event loop
        # Concurrent /generate calls run as one engine batch (stacx.serving.request_batching).
        self.batcher = GenerateBatcher(engine) if engine is not None else None
        self.aborts: AbortBook = getattr(engine, "aborts", None) or AbortBook()
        """Every /generate request from its arrival to its answer, for /abort_request."""
        self.openai: Optional[OpenAIEndpoints] = None
        """The OpenAI-compatible endpoint and its session book (set by build_app)."""
        self.app = build_app(self)
        self._socket = _listening_socket(host, port)
        config = uvicorn.Config(
            PerClientLimit(self.app, max_requests=limits.max_requests_per_client),
            http=guarded_h11_protocol(limits, self.connections), loop="asyncio", ws="none", lifespan="off",
            log_config=None, access_log=False, proxy_headers=False,  # the client address is the socket's
            timeout_keep_alive=limits.keep_alive_timeout_s, backlog=LISTEN_BACKLOG, timeout_graceful_shutdown=2,
            # the protocol refuses connection max_connections + 1 itself (503 naming the flag); this is a backstop
            limit_concurrency=limits.max_connections + 1, server_header=False,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = self._socket.getsockname()[0]
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> "EngineHttpServer":
        """Serve from a background thread; returns once the server accepts requests."""
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="stacx-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server on {self.url} did not start within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.005)
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted (KeyboardInterrupt, which `stacx serve` raises on SIGTERM)."""
        if self._thread is None:
            self.start()
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        """Stop serving, release the socket and remove the shared-memory staging files. Safe before
        `start()` and safe to call twice."""
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                self._uvicorn.force_exit = True
                self._thread.join(timeout=5)
            self._thread = None
        self.close()

    def close(self) -> None:
        """Release the socket and remove the staging files. Safe to call twice."""
        try:
            self._socket.close()
        finally:
            self.shm_registry.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- admission, access and health ------------------------------------------------------------

    def lane_of(self, request: Request) -> str:
        """TRAINER_LANE for a call that carries the server's own key (the training run's generation), else
        SHARED_LANE (agents' `/v1/*` and session traffic, other clients): each lane has its own admission count
        and worker threads, so agent traffic that fills its queue never makes the trainer's calls wait or fail."""
        if self.api_key and check_bearer_token(self.api_key, presented_authorization(request.headers)) is None:
            return TRAINER_LANE
        return SHARED_LANE

    def admit_generate(self, lane: str = SHARED_LANE) -> None:
        """Count one more generation call into `lane`, or raise 503 when `max_queued_requests` are admitted
        there (the event loop's thread only)."""
        if self._admitted[lane] >= self.limits.max_queued_requests:
            raise HttpError(503, f"generation queue is full ({self._admitted[lane]} {lane} requests admitted, "
                                 f"max_queued_requests {self.limits.max_queued_requests}); retry later",
                            headers={"Retry-After": "1"})
        self._admitted[lane] += 1

    def release_generate(self, lane: str = SHARED_LANE) -> None:
        self._admitted[lane] -= 1

    def generate_threads(self, lane: str = SHARED_LANE) -> anyio.CapacityLimiter:
        """Worker threads for generation in `lane`: one per admitted call, so a full queue never starves the rest."""
        if lane not in self._generate_threads:
            self._generate_threads[lane] = anyio.CapacityLimiter(self.limits.max_queued_requests)
        return self._generate_threads[lane]

    async def run_engine(self, request: Request, requests: list, *, flags: Optional[list] = None) -> list:
        """Generate for `requests` on behalf of the HTTP `request` (the event loop's thread): admitted
        against max_queued_requests, waiting while paused, abortable by rid, stopped when the client
        leaves; 503 when generation stays paused for pause_timeout_s. flags: their abort flags, registered
        by the caller (a streamed answer reads their outputs); None: registered here."""
        lane = self.lane_of(request)
        self.admit_generate(lane)
        gone = threading.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(request, gone))
        if flags is None:
            flags = self.aborts.register([r.rid for r in requests])  # abortable from arrival on

        def run():
            deadline = time.monotonic() + self.pause_timeout_s
            while not self.gate.wait(0.1):  # paused: wait, unless every request is aborted meanwhile
                if all(flag.is_set() for flag in flags):
                    break
                if gone.is_set():
                    raise GenerationCancelled()
                if time.monotonic() > deadline:
                    return None
            if gone.is_set():
                raise GenerationCancelled()
            return self.batcher.generate(requests, should_stop=gone.is_set, abort_flags=flags)

        try:
            outputs = await anyio.to_thread.run_sync(run, limiter=self.generate_threads(lane))
        finally:
            self.aborts.release(flags)
            watcher.cancel()
            self.release_generate(lane)
        if outputs is None:
            raise HttpError(503, f"generation stayed paused for pause_timeout_s ({self.pause_timeout_s:.0f}s); "
                                 "send /continue_generation")
        return outputs

    def check_access(self, path: str, authorization: Optional[str]) -> None:
        """Raise HttpError (403, 401) unless `path` may be called with this Authorization header."""
        if path not in MUTATING_ENDPOINTS:
            return
        if path in WEIGHT_ENDPOINTS and not self.weight_updates:
            raise HttpError(403, f"{path}: this server takes no weight updates (started with --no-weight-updates); "
                                 "restart it without that flag to push weights", close=True)
        if self.api_key is None:
            raise HttpError(403, f"{path}: this server has no API key (--no-weight-updates without --api-key), so "
                                 "nobody may pause, continue, abort or flush it; restart it with --api-key KEY", close=True)
        refusal = check_bearer_token(self.api_key, authorization)
        if refusal is not None:
            status, message = refusal
            raise HttpError(status, f"{path}: {message}", close=True, headers={"WWW-Authenticate": "Bearer"})

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

    # ---- weights (worker threads) ----------------------------------------------------------------

    def apply_bucket(self, flat, header: dict, *, where: str) -> dict:
        """Load one validated bucket if it moves the version forward (409 otherwise); the engine
        checks every name and shape, and this every value, before writing any."""
        with self.versions.lock:
            self.versions.admit(header, self.engine.weight_version(), where=where)
            named = unflatten_bucket(flat)
            refuse_non_finite(named, where=where)
            self.engine.load_weights(named)
            if header["final"]:
                self.engine.set_weight_version(header["version"])
            self.versions.record(header)
        return {"success": True, "message": f"loaded {len(flat.slots)} tensors",
                "weight_version": str(self.engine.weight_version())}


def _listening_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


class JsonResponse(Response):
    """JSON like the standard library writes it (Starlette's refuses -inf, a legal log-prob)."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return json.dumps(content).encode()


Handler = Callable[[Request], Awaitable[tuple[int, object]]]


def build_app(server: EngineHttpServer) -> FastAPI:
    """The FastAPI application: SGLang's endpoints and Stacx's weight endpoints over `server`."""
    app = FastAPI(title="stacx serve", summary="Stacx's CPU engine behind SGLang's native HTTP API subset",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    endpoints = _Endpoints(server)
    json_body = {"requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}}}
    routes = [
        (("GET",), "/health", endpoints.health, "200 when the engine can serve, 503 when it is wedged", None),
        (("GET",), "/health_generate", endpoints.health, "the same as /health", None),
        (("GET", "POST"), "/get_model_info", endpoints.model_info, "model path and served weight version", None),
        (("GET",), "/get_weight_version", endpoints.weight_version, "the served weight version", None),
        (("POST",), "/generate", endpoints.generate,
         "SGLang's generate: `text` or `input_ids` (one or a list), `sampling_params`, log-prob fields", json_body),
        (("POST",), "/pause_generation", endpoints.pause, "new /generate calls wait (needs the API key)", None),
        (("POST",), "/continue_generation", endpoints.resume, "release paused calls (needs the API key)", None),
        (("POST",), "/abort_request", endpoints.abort,
         "{rid} or {abort_all: true}: stop those /generate calls; each answers its tokens so far (needs the API key)",
         json_body),
        (("GET", "POST"), "/flush_cache", endpoints.flush_cache, "drop cached state (needs the API key)", None),
        (("POST",), BUCKET_ENDPOINT, endpoints.update_bucket,
         "one weight bucket: 8-byte header length, JSON header, raw tensors (needs the API key)",
         {"requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}),
        (("POST",), SHM_STAGING_ENDPOINT, endpoints.shm_staging,
         "create a same-host staging file: {} -> {staging_id, path} (needs the API key)", None),
        (("POST",), SHM_BUCKET_ENDPOINT, endpoints.update_from_shm,
         "load the bucket staged under staging_id: bucket header + staging_id (needs the API key)", json_body),
        (("POST",), SHM_RELEASE_ENDPOINT, endpoints.shm_release, "{staging_id}: remove that staging file", json_body),
        (("POST",), DIGEST_ENDPOINT, endpoints.weight_digests,
         "{names}: {digests: {name: digest}, dtype} of the served weights (the post-sync check)", json_body),
    ]
    server.openai = OpenAIEndpoints(server, endpoints._json)
    routes += server.openai.routes(json_body)
    routes += AnthropicEndpoints(server.openai).routes(json_body)
    for methods, path, handler, summary, extra in routes:
        app.add_api_route(path, endpoints.answering(handler), methods=list(methods), summary=summary,
                          name=path.strip("/").replace("/", "_"), openapi_extra=extra,
                          response_class=JsonResponse)
    known = sorted({path for _, path, *_ in routes})

    @app.exception_handler(StarletteHTTPException)
    async def unknown_endpoint(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            message = f"unknown endpoint {request.method} {request.url.path}; known: {known}"
        else:
            message = f"{request.method} {request.url.path}: {err.detail}"
        body = openai_error_body(err.status_code, message) if is_openai_path(request.url.path) else {"error": message}
        return JsonResponse(body, err.status_code, headers=getattr(err, "headers", None))

    return app


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    """Set `gone` when the client closes the connection (once the body is read, the next ASGI
    message is the disconnect or nothing)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


class _Endpoints:
    """The endpoint handlers: each returns (status, JSON body, or a Response it streams itself);
    `answering` maps errors to answers (in OpenAI's schema on /v1/ paths, openai_errors.py)."""

    def __init__(self, server: EngineHttpServer):
        self.server = server
        self.limits = server.limits

    def answering(self, handler: Handler):
        server = self.server

        async def endpoint(request: Request) -> Response:
            path = request.url.path
            headers: dict = {}
            try:
                server.check_access(path, presented_authorization(request.headers))
                status, body = await handler(request)
                if isinstance(body, Response):  # answered already (an event stream, another API's schema)
                    return body
            except GenerationCancelled:
                logger.info("%s %s: the client disconnected; generation stopped", request.method, path)
                status, body, headers = 503, {"error": "the client disconnected"}, {"Connection": "close"}
            except HttpError as err:
                status, body, headers = err.status, {"error": str(err)}, dict(err.headers)
                if err.close:
                    headers["Connection"] = "close"
            except StaleWeightsError as err:
                status, body = 409, {"error": str(err), **err.fields}
            except ValueError as err:  # the caller's mistake
                status, body = 400, {"error": str(err)}
            except Exception as err:  # an engine failure: the client may retry
                logger.exception("%s %s failed", request.method, path)
                status, body = 500, {"error": f"{type(err).__name__}: {err}"}
            if isinstance(body, Response):  # a streamed answer (stream: true on the OpenAI endpoint)
                return body
            if status >= 400 and is_openai_path(path) and isinstance(body.get("error"), str):
                body = openai_error_body(status, body["error"])
            return JsonResponse(body, status, headers=headers)

        return endpoint

    async def _small_body(self, request: Request) -> None:
        """Endpoints that take no body: refuse a large one (413) before any of it is read."""
        content_length(request, self.limits.max_body_bytes)

    async def _json(self, request: Request):
        return await read_json(request, limit=self.limits.max_body_bytes, timeout_s=self.limits.read_timeout_s)

    async def health(self, request: Request):
        return self.server.health_report()

    async def model_info(self, request: Request):
        await self._small_body(request)
        return 200, {"model_path": self.server.model_path, "is_generation": True,
                     "weight_version": str(self.server.engine.weight_version()),
                     STREAM_CAPABILITY: True}  # its /generate streams (generate_stream)

    async def weight_version(self, request: Request):
        return 200, {"weight_version": str(self.server.engine.weight_version())}

    async def generate(self, request: Request):
        server = self.server
        payload = await self._json(request)
        if isinstance(payload, dict) and payload.get("text") is not None:
            check_text_budget(payload["text"], server.max_text_chars, "/generate: 'text'")
        streamed = stream_asked(payload)  # the tokens as they come, then the answer (stacx.serving.generate_stream)
        # Tokenizing (and checking a long id list) runs off the event loop: /health and every other request go on.
        requests, is_batch = await anyio.to_thread.run_sync(parse_generate_payload, payload, server.tokenizer)
        if streamed:
            return 200, StreamingResponse(stream_generate(server, request, requests, is_batch),
                                          media_type="application/x-ndjson")
        outputs = await server.run_engine(request, requests)
        items = [render_generate_item(o, r, r.rid or uuid.uuid4().hex, server.tokenizer)
                 for o, r in zip(outputs, requests)]
        return 200, items if is_batch else items[0]

    async def pause(self, request: Request):
        await self._small_body(request)
        self.server.gate.pause()
        engine_pause = getattr(self.server.engine, "pause", None)
        if engine_pause is not None:  # calls already queued for the engine do not start either
            engine_pause()
        return 200, {"success": True, "message": "Generation paused successfully."}

    async def resume(self, request: Request):
        await self._small_body(request)
        engine_resume = getattr(self.server.engine, "resume", None)
        if engine_resume is not None:
            engine_resume()
        self.server.gate.resume()
        return 200, {"success": True, "message": "Generation continued successfully."}

    async def abort(self, request: Request):
        rids = parse_abort_payload(await self._json(request))
        num_aborted = self.server.aborts.abort(rids)
        return 200, {"success": True, "num_aborted": num_aborted}

    async def flush_cache(self, request: Request):
        await self._small_body(request)
        await anyio.to_thread.run_sync(self.server.engine.flush_cache)
        return 200, {"success": True}

    async def update_bucket(self, request: Request):
        server = self.server
        length = content_length(request, server.weight_body_limit)  # 413 before anything is allocated
        async with server._weight_lock:
            body = bytearray(length)
            await read_body_into(request, body, timeout_s=self.limits.read_timeout_s)

            def apply():
                flat, header = decode_bucket_body(body, where=BUCKET_ENDPOINT)
                return server.apply_bucket(flat, header, where=BUCKET_ENDPOINT)

            return 200, await anyio.to_thread.run_sync(apply)

    async def weight_digests(self, request: Request):
        body = await self._json(request)
        names = body.get("names") if isinstance(body, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f'{DIGEST_ENDPOINT}: body must be {{"names": [tensor names]}}')
        return 200, await anyio.to_thread.run_sync(self.server.engine.weight_digests, names)

    async def shm_staging(self, request: Request):
        await self._small_body(request)
        staging_id, path = await anyio.to_thread.run_sync(self.server.shm_registry.create)
        return 200, {"staging_id": staging_id, "path": path}

    async def shm_release(self, request: Request):
        body = await self._json(request)
        if not isinstance(body, dict) or not isinstance(body.get("staging_id"), str):
            raise ValueError(f"{SHM_RELEASE_ENDPOINT}: body must be {{\"staging_id\": <string>}}")
        return 200, {"success": await anyio.to_thread.run_sync(self.server.shm_registry.release, body["staging_id"])}

    async def update_from_shm(self, request: Request):
        server = self.server
        header = await self._json(request)
        async with server._weight_lock:
            def apply():
                flat = server.shm_registry.read(header, where=SHM_BUCKET_ENDPOINT)
                return server.apply_bucket(flat, header, where=SHM_BUCKET_ENDPOINT)

            return 200, await anyio.to_thread.run_sync(apply)
