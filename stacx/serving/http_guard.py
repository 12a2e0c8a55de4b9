"""The protective layer of `stacx serve`'s HTTP server: limits, refusals, the bearer-token check and
the two pieces that bound what connections and clients can hold. `stacx.serving.server`
builds the endpoints on top of it.

- `guarded_h11_protocol(limits)`: uvicorn's h11 connection protocol with a connection cap (at the
  cap, the longest-idle connection is closed to admit a new one; when every connection has a request
  in progress, one more is answered 503 at once and closed), a deadline on request heads (a connection
  that has not sent a whole request head within `read_timeout_s`, a fresh one or one idle
  between requests, is closed) and a 400 that names what was malformed.
- `PerClientLimit`: an ASGI middleware that keeps one client address (keyed by host) to
  `max_requests_per_client` requests in flight; more get 503 with Retry-After (and the
  connection closed).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """Bounds on what one client can make the server hold (see the module docstring)."""

    max_body_bytes: int = 64 * 1024 * 1024
    """Largest JSON request body; a larger Content-Length is answered 413 before any allocation."""
    max_weight_body_bytes: int = 16 * 1024 ** 3
    """Upper cap of a binary weight-bucket body (`/stacx/update_weights_bucket`, authenticated). The
    server's own bound is lower: its model's parameter bytes plus a header (`EngineHttpServer`)."""
    read_timeout_s: float = 60.0
    """Longest wait for a request head (on a new connection, or between requests), for a whole JSON
    body, and for each part of a weight body."""
    keep_alive_timeout_s: float = 15.0
    """An idle keep-alive connection is closed after this long without a new request."""
    max_connections: int = 1024
    """Open connections at once; at the cap the longest-idle one is closed to admit a new one, and only when every
    open connection has a request in progress is one more answered 503 and closed."""
    max_requests_per_client: int = 64
    """Requests one client address may have in flight at once; more get 503 with Retry-After.
    Every local process shares the address 127.0.0.1."""
    max_queued_requests: int = 64
    """`/generate` calls admitted at once (running or waiting for the engine); more get 503."""
    stall_timeout_s: float = 300.0
    """`/health` reports the engine wedged when a call made no progress for this long."""
    max_chars_per_token: int = 32
    """A request's text (a `/generate` prompt, a chat's messages and tools) longer than this many characters per
    token of the model's context is refused (400) before it is tokenized: it cannot fit the context (the longest
    tokens of common vocabularies are 16-32 characters), and tokenizing 10 MB took seconds and gigabytes."""

    def __post_init__(self):
        for name in ("max_body_bytes", "max_weight_body_bytes", "max_connections", "max_requests_per_client",
                     "max_queued_requests", "max_chars_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout_s", "keep_alive_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerLimits.{name} must be > 0, got {getattr(self, name)}")


class HttpError(Exception):
    """A protocol-level refusal with its status (413, 411, 401, 503, ...), message and extra answer
    headers; `close`: the connection closes after the answer (a body was left unread)."""

    def __init__(self, status: int, message: str, *, close: bool = False, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.close, self.headers = status, close, dict(headers or {})


def presented_authorization(headers) -> Optional[str]:
    """The request's Authorization header; without one, `x-api-key: KEY` (how Anthropic clients send
    their key) as `Bearer KEY`, so either header carries the server's key."""
    authorization = headers.get("authorization")
    if authorization or not headers.get("x-api-key"):
        return authorization
    return f"Bearer {headers['x-api-key']}"


def check_bearer_token(api_key: Optional[str], header: Optional[str]) -> Optional[tuple[int, str]]:
    """None when `Authorization: Bearer <api_key>` is presented; else (401 when the header is
    missing, 403 when the key is wrong, message). Compared in constant time
    (`hmac.compare_digest`), so the answer time does not reveal how much of a guess matched.
    `api_key` None (a server without a key) allows nothing: the caller refuses before asking."""
    if not header:
        return 401, ("this endpoint needs 'Authorization: Bearer <api key>' or 'x-api-key: <api key>' (the server's "
                     "--api-key / STACX_API_KEY)")
    scheme, _, token = header.strip().partition(" ")
    presented = token.strip().encode("utf-8", "surrogateescape")
    expected = (api_key or "").encode()
    if scheme.lower() != "bearer" or not api_key or not hmac.compare_digest(presented, expected):
        return 403, "the API key is wrong"
    return None


def error_head(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer `{"error": message}` that closes the connection (written raw, outside h11)."""
    body = json.dumps({"error": message}).encode()
    retry = "Retry-After: 1\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{retry}Connection: close\r\n\r\n").encode() + body


class ConnectionCounter:
    """Open connections of one server, and which of them are idle (waiting for a request head), oldest first;
    the event loop's thread only touches it."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.open = 0
        self.idle: dict = {}  # protocol -> None, in the order they became idle (dicts keep insertion order)
        self.evicted_idle = 0

    def make_room(self) -> bool:
        """At the cap, close the longest-idle connection so a new one can be served (an idle keep-alive
        connection may be closed at any time: its client opens another). False when none is idle."""
        if self.open < self.max_connections:
            return True
        if not self.idle:
            return False
        oldest = next(iter(self.idle))
        oldest.close_idle()
        self.evicted_idle += 1
        return True


def guarded_h11_protocol(limits: ServerLimits, counter: ConnectionCounter) -> type:
    """uvicorn's h11 protocol class with the connection cap and the request-head deadline (module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._admitted = False
            self._head_deadline: Optional[asyncio.TimerHandle] = None
            self._protocol_error = ""
            parse = self.conn.next_event

            def next_event():  # remember why h11 refused a request, for the 400 answer
                try:
                    return parse()
                except h11.RemoteProtocolError as err:
                    self._protocol_error = str(err)
                    raise

            self.conn.next_event = next_event

        def connection_made(self, transport) -> None:
            if not counter.make_room():  # every open connection has a request in progress
                transport.write(error_head(503, "Service Unavailable", "the server is serving its maximum of "
                                           f"{counter.max_connections} busy connections (--max-connections); "
                                           "retry later"))
                transport.close()
                return
            counter.open += 1
            self._admitted = True
            super().connection_made(transport)
            self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            self._release()
            super().connection_lost(exc)

        def _release(self) -> None:
            """Count this connection out (once): closed by its client, the deadline, or eviction."""
            if not self._admitted:
                return
            self._admitted = False
            counter.open -= 1
            counter.idle.pop(self, None)
            self._cancel_head_deadline()

        def close_idle(self) -> None:
            """Closed to make room for a new connection: counted out now, so the new one is admitted at once."""
            self._release()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._admitted:
                counter.idle.pop(self, None)  # a request is arriving: no longer idle
                super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def send_400_response(self, msg: str) -> None:
            """A JSON 400 naming what h11 refused, with its Content-Length, then close."""
            self.transport.write(error_head(400, "Bad Request", f"{msg} {self._protocol_error}".strip()))
            self.transport.close()

        def _arm_head_deadline(self) -> None:
            """Waiting for a request head from here on: idle (evictable at the cap) until one arrives."""
            self._cancel_head_deadline()
            if not self.transport.is_closing():
                self._head_deadline = self.loop.call_later(limits.read_timeout_s, self._head_deadline_passed)
                if self._admitted:
                    counter.idle.pop(self, None)
                    counter.idle[self] = None

        def _cancel_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_deadline_passed(self) -> None:
            """No whole request head arrived within read_timeout_s: close (a request in progress is
            the endpoint's to time out)."""
            self._head_deadline = None
            waiting_for_head = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
            if waiting_for_head and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


BOUNDED_PATHS = frozenset({"/generate"})
"""The requests `PerClientLimit` counts: generation, the work one client could hog. Control requests
(abort, pause, continue, weight updates, health, reads) are never refused for it: a client whose
generations fill its bound must still be able to abort them."""


class PerClientLimit:
    """ASGI middleware: at most `max_requests` BOUNDED_PATHS requests in flight per client host; more
    get 503. Runs on the event loop's one thread, so the counts need no lock."""

    def __init__(self, app, *, max_requests: int):
        self.app = app
        self.max_requests = max_requests
        self.in_flight: Counter = Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in BOUNDED_PATHS:
            await self.app(scope, receive, send)
            return
        host = (scope.get("client") or ("unknown", 0))[0]
        if self.in_flight[host] >= self.max_requests:
            body = json.dumps({"error": f"client {host} already has {self.in_flight[host]} requests in flight "
                                        f"(--max-requests-per-client {self.max_requests}); retry later"}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"connection", b"close"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight[host] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[host] -= 1
            if not self.in_flight[host]:
                del self.in_flight[host]
