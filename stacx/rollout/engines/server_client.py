"""What every engine client of one HTTP server shares (`HttpEngine` for `stacx serve` and SGLang, `VllmEngine`):
the server's transport and URL, how weight buckets travel to it, and its health check."""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlparse

from stacx.network import is_loopback_host
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import HttpTransport, RetryPolicy

WEIGHT_TRANSPORTS = ("auto", "http", "shm")
"""How weight buckets reach the server: 'http' in the request body; 'shm' staged in a same-host shared-memory file
and only their metadata sent; 'auto' shm for a loopback URL, else http."""


class ServerClient(InferenceEngine):
    """An engine client that talks to one server URL."""

    max_concurrent_submissions = 64
    """`submit`'s requests in flight at once: `stacx serve`'s default bound per client
    (`--max-requests-per-client`, `--max-queued-requests`); more wait here instead of drawing 503s."""

    def __init__(self, url: str, retry: RetryPolicy, *, api_key: Optional[str], weight_transport: str):
        """weight_transport: one of WEIGHT_TRANSPORTS. api_key: the server's shared secret (None: `STACX_API_KEY`
        if set)."""
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport must be one of {WEIGHT_TRANSPORTS}, got {weight_transport!r}")
        self.transport = HttpTransport(url, retry, api_key=api_key, max_connections=self.max_concurrent_submissions + 2)
        loopback = is_loopback_host(urlparse(self.transport.url).hostname)
        self.weight_transport = ("shm" if loopback else "http") if weight_transport == "auto" else weight_transport
        """'http' or 'shm': how this client sends weight buckets ('auto' resolved by the URL)."""

    @property
    def url(self) -> str:
        return self.transport.url

    def health(self) -> bool:
        return self.transport.answers_health()


__all__ = ["WEIGHT_TRANSPORTS", "ServerClient"]
