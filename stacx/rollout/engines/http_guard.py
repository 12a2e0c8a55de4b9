"""The protective layer of `stacx serve`'s HTTP server: limits, refusals, the connection cap and the
bearer-token check. `stacx.rollout.engines.server` builds the endpoints on top of it.
"""

from __future__ import annotations

import hmac
import json
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """Bounds on what one client can make the server hold (see the module docstring)."""

    max_body_bytes: int = 64 * 1024 * 1024
    """Largest JSON request body; a larger Content-Length is answered 413 before any allocation."""
    max_weight_body_bytes: int = 16 * 1024 ** 3
    """Largest binary weight-bucket body (`/stacx/update_weights_bucket`, authenticated)."""
    read_timeout_s: float = 60.0
    """Longest wait for any socket read, and for a whole JSON body; idle keep-alive connections close after it."""
    max_connections: int = 64
    """Connections served at once (one thread each); more are answered 503 and closed."""
    max_queued_requests: int = 64
    """`/generate` calls admitted at once (running or waiting for the engine); more get 503."""
    stall_timeout_s: float = 300.0
    """`/health` reports the engine wedged when a call made no progress for this long."""

    def __post_init__(self):
        for name in ("max_body_bytes", "max_weight_body_bytes", "max_connections", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerLimits.{name} must be > 0, got {getattr(self, name)}")


class HttpError(Exception):
    """A protocol-level refusal with its status (413, 411, 503, ...) and message."""

    def __init__(self, status: int, message: str, *, close: bool = False):
        super().__init__(message)
        self.status, self.close = status, close


class BoundedHTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections` of them; the rest get 503 and are closed."""

    daemon_threads = True

    def __init__(self, address, handler_cls, *, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        super().__init__(address, handler_cls)

    @property
    def num_free_connection_slots(self) -> int:
        """Connections this server would still accept now (max_connections minus those held)."""
        return self._slots._value

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            refuse_connection(request, f"the server is serving its maximum of {self.max_connections} connections")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def refuse_connection(sock, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(head + body)
    except OSError:
        pass


def check_bearer_token(api_key: Optional[str], header: Optional[str]) -> Optional[tuple[int, str]]:
    """None when allowed (no key configured, or `Authorization: Bearer <api_key>`); else
    (401 when the header is missing, 403 when the key is wrong, message). Compared in constant
    time (`hmac.compare_digest`), so the answer time does not reveal how much of a guess matched."""
    if api_key is None:
        return None
    if not header:
        return 401, "this endpoint needs 'Authorization: Bearer <api key>' (the server's --api-key / STACX_API_KEY)"
    scheme, _, token = header.strip().partition(" ")
    presented = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented, api_key.encode()):
        return 403, "the API key is wrong"
    return None
