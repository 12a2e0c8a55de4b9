"""HTTP transport to an inference or teacher server, with timeouts, retries and backoff.

Connection failures, timeouts and 5xx answers are retried with exponential backoff
(`backoff_s * 2**attempt`, capped at `backoff_max_s`); when the budget is spent the error names
the server, the endpoint and a summary of the request. A 4xx answer is the caller's mistake and
is raised at once with the server's message.

Authentication: with an API key (given, or from the `STACX_API_KEY` environment variable), every
request carries `Authorization: Bearer <key>`, the header both `stacx serve` and SGLang's
`--api-key` check.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import requests

from stacx.ranges import require_in_range

logger = logging.getLogger(__name__)

API_KEY_ENV = "STACX_API_KEY"
"""Environment variable holding the shared secret of Stacx's inference servers and their clients."""


def api_key_from_env() -> Optional[str]:
    """The `STACX_API_KEY` environment variable, or None when it is unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


class ServerUnavailableError(RuntimeError):
    """The server did not answer successfully within the retry budget."""

    def __init__(self, url: str, endpoint: str, request_summary: str, attempts: int, last_error: str):
        self.url, self.endpoint, self.attempts = url, endpoint, attempts
        super().__init__(
            f"server {url} did not answer {endpoint} after {attempts} attempts "
            f"(request: {request_summary}); last error: {last_error}"
        )


class ServerRequestError(RuntimeError):
    """The server rejected the request (HTTP 4xx); retrying would not help. `answer`: the server's
    decoded JSON answer (None when it sent none)."""

    def __init__(self, message: str, status_code: int = 400, answer: Any = None):
        super().__init__(message)
        self.status_code = status_code
        self.answer = answer


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to try before declaring a server down."""

    timeout_s: float = 120.0
    """Per-attempt timeout (connect + read)."""
    max_attempts: int = 5
    """Total attempts, the first one included."""
    backoff_s: float = 0.5
    """Sleep before the second attempt; doubled each further attempt."""
    backoff_max_s: float = 10.0
    """Longest sleep between two attempts."""

    def __post_init__(self):
        require_in_range("max_attempts", self.max_attempts, at_least=1)
        require_in_range("timeout_s", self.timeout_s, above=0)

    def sleep_before(self, attempt: int) -> float:
        """Seconds to wait before attempt number `attempt` (1-based; attempt 1 waits 0)."""
        if attempt <= 1:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 2))


class HttpTransport:
    """JSON and binary requests to one server URL (e.g. http://127.0.0.1:30000)."""

    def __init__(self, url: str, retry: RetryPolicy = RetryPolicy(), *, api_key: Optional[str] = None,
                 max_connections: int = 10):
        """api_key: the server's shared secret (None: `STACX_API_KEY` if set, else no header).
        max_connections: connections kept open for reuse (as many as threads calling at once)."""
        self.url = url.rstrip("/")
        self.retry = retry
        self.closed = False
        """Set by `close`: a request still retrying (its server died) stops at its next attempt."""
        self._session = requests.Session()
        if max_connections != 10:  # requests' default pool size
            adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max_connections)
            self._session.mount("http://", adapter)
            self._session.mount("https://", adapter)
        api_key = api_key or api_key_from_env()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def request(
        self,
        method: str,
        endpoint: str,
        *,
        json_body: Any = None,
        data: Optional[bytes | Iterable[bytes]] = None,
        summary: str = "",
        retry: Optional[RetryPolicy] = None,
    ) -> Any:
        """Send, retrying per the policy; returns the decoded JSON answer (or text if not JSON)."""
        policy = retry or self.retry
        last_error = ""
        for attempt in range(1, policy.max_attempts + 1):
            time.sleep(policy.sleep_before(attempt))
            if self.closed:  # the pool gave this server up (stacx.rollout.engine_health): no further attempt
                raise ServerUnavailableError(self.url, endpoint, summary or "-", attempt - 1,
                                             last_error or "the client was closed")
            try:
                response = self._session.request(
                    method, self.url + endpoint, json=json_body, data=data, timeout=policy.timeout_s
                )
            except (requests.ConnectionError, requests.Timeout) as err:
                last_error = f"{type(err).__name__}: {err}"
                logger.warning("%s%s attempt %d/%d failed: %s", self.url, endpoint, attempt, policy.max_attempts, last_error)
                continue
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
                logger.warning("%s%s attempt %d/%d failed: %s", self.url, endpoint, attempt, policy.max_attempts, last_error)
                continue
            if response.status_code >= 400:
                raise ServerRequestError(
                    f"server {self.url} rejected {endpoint} (request: {summary or '-'}): "
                    f"HTTP {response.status_code}: {response.text[:500]}",
                    response.status_code, _json_or_none(response),
                )
            try:
                return response.json()
            except (json.JSONDecodeError, ValueError):
                return response.text
        raise ServerUnavailableError(self.url, endpoint, summary or "-", policy.max_attempts, last_error)

    def post_lines(self, endpoint: str, body: Any, *, summary: str = "") -> Iterator[Any]:
        """POST `body` and yield each JSON line of the streamed answer as it arrives. Until the answer starts
        the request is retried as `request` retries it; once it has started, a break is not retried (what
        arrived is the caller's to keep): `ServerUnavailableError` when the server does not answer, answers
        5xx after the retries, or the answer breaks off; `ServerRequestError` on 4xx."""
        with self._streamed_answer(endpoint, body, summary=summary) as lines:
            for line in lines:
                if line:
                    yield json.loads(line)

    def post_events(self, endpoint: str, body: Any, *, summary: str = "") -> Iterator[Any]:
        """POST `body` and yield the JSON data of each server-sent event (`data: {...}`, the OpenAI servers'
        streamed answers: vLLM's, SGLang's) as it arrives, until `data: [DONE]`; other event fields are skipped.
        Retried and failing as `post_lines`; an answer that ends before `[DONE]` broke off."""
        with self._streamed_answer(endpoint, body, summary=summary) as lines:
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
        raise ServerUnavailableError(self.url, endpoint, summary or "-", 1, "the answer ended before its [DONE] event")

    @contextlib.contextmanager
    def _streamed_answer(self, endpoint: str, body: Any, *, summary: str) -> Iterator[Iterator[bytes]]:
        """The lines of a streamed POST answer (module doc of `post_lines`: retried until it starts, never after)."""
        policy, last_error, response = self.retry, "", None
        for attempt in range(1, policy.max_attempts + 1):
            time.sleep(policy.sleep_before(attempt))
            if self.closed:
                raise ServerUnavailableError(self.url, endpoint, summary or "-", attempt - 1,
                                             last_error or "the client was closed")
            try:
                response = self._session.post(self.url + endpoint, json=body, stream=True, timeout=policy.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as err:
                last_error, response = f"{type(err).__name__}: {err}", None
                continue
            if response.status_code < 500:
                break
            last_error = f"HTTP {response.status_code}: {response.text[:300]}"
            response.close()
            response = None
        if response is None:
            raise ServerUnavailableError(self.url, endpoint, summary or "-", policy.max_attempts, last_error)
        with response:
            if response.status_code >= 400:
                raise ServerRequestError(f"server {self.url} rejected {endpoint} (request: {summary or '-'}): "
                                         f"HTTP {response.status_code}: {response.text[:500]}",
                                         response.status_code, _json_or_none(response))
            try:
                yield response.iter_lines()
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as err:
                raise ServerUnavailableError(self.url, endpoint, summary or "-", 1,
                                             f"the answer broke off: {type(err).__name__}: {err}") from err

    def post_json(self, endpoint: str, body: Any, *, summary: str = "", retry: Optional[RetryPolicy] = None) -> Any:
        return self.request("POST", endpoint, json_body=body, summary=summary, retry=retry)

    def get(self, endpoint: str, *, retry: Optional[RetryPolicy] = None) -> Any:
        return self.request("GET", endpoint, retry=retry)

    def answers_health(self, endpoint: str = "/health", timeout_s: float = 5.0) -> bool:
        """Whether the server answers `endpoint` now (one try, `timeout_s`); any failure means "not serving"."""
        try:
            self.get(endpoint, retry=RetryPolicy(timeout_s=timeout_s, max_attempts=1))
            return True
        except Exception:  # noqa: BLE001 - any failure means "not serving now"
            return False

    def close(self) -> None:
        self.closed = True
        self._session.close()


def _json_or_none(response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
