"""`InferenceEngine` over SGLang's native HTTP API, served by `stacx serve` (CPU) or SGLang.

Generation, pause/resume, flush and health use SGLang's own endpoints. Weight updates go to
`stacx serve`'s binary bucket endpoint (`/stacx/update_weights_bucket`, see weight_transfer.py);
the SGLang engine overrides `update_weights` with SGLang's tensor / distributed endpoints.
"""

from __future__ import annotations

from typing import Iterable, Sequence
from urllib.parse import urlparse

from stacx.rollout.engine import InferenceEngine, WeightBucket
from stacx.rollout.http_client import HttpTransport, RetryPolicy
from stacx.rollout.sglang_protocol import build_generate_payload, parse_generate_response
from stacx.rollout.types import GenerateOutput, GenerateRequest
from stacx.rollout.weight_transfer import SharedMemoryStaging, bucket_wire_chunks

BUCKET_ENDPOINT = "/stacx/update_weights_bucket"
SHM_BUCKET_ENDPOINT = "/stacx/update_weights_from_shm"
WEIGHT_TRANSPORTS = ("auto", "http", "shm")


def summarize_requests(requests: Sequence[GenerateRequest]) -> str:
    lengths = [len(r.input_ids) for r in requests]
    return (f"{len(requests)} sequences, prompt lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''}, "
            f"max_new_tokens {requests[0].sampling.max_new_tokens}")


class HttpEngine(InferenceEngine):
    """Talks to one server URL."""

    def __init__(self, url: str, retry: RetryPolicy = RetryPolicy(), *, weight_transport: str = "auto"):
        """weight_transport: 'http' sends bucket bytes in the request body; 'shm' stages them in a
        same-host shared-memory file and sends only metadata; 'auto' picks shm for a loopback URL."""
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport must be one of {WEIGHT_TRANSPORTS}, got {weight_transport!r}")
        self.transport = HttpTransport(url, retry)
        host = urlparse(self.transport.url).hostname
        self.weight_transport = ("shm" if host in ("127.0.0.1", "localhost", "::1") else "http") \
            if weight_transport == "auto" else weight_transport
        self._staging: SharedMemoryStaging | None = None

    @property
    def url(self) -> str:
        return self.transport.url

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        if not requests:
            return []
        body = self.transport.post_json("/generate", build_generate_payload(requests), summary=summarize_requests(requests))
        return parse_generate_response(body, requests)

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        pending = None
        for bucket in buckets:
            if pending is not None:
                self._send_bucket(pending, version=version, final=False)
            pending = bucket
        if pending is None:
            raise ValueError("update_weights: no buckets given")
        self._send_bucket(pending, version=version, final=True)

    def _send_bucket(self, bucket: WeightBucket, *, version: int, final: bool) -> None:
        if self.weight_transport == "shm":
            if self._staging is None:
                self._staging = SharedMemoryStaging()
            header = self._staging.write(bucket, version=version, final=final)
            self.transport.post_json(SHM_BUCKET_ENDPOINT, header, summary=f"{len(bucket)} tensors via {header['path']}")
            return
        # the tensors' own memory goes to the socket; the server receives one flat buffer
        chunks = bucket_wire_chunks(bucket, version=version, final=final)
        body = _ChunkedBody(chunks)
        self.transport.request(
            "POST", BUCKET_ENDPOINT, data=body, summary=f"{len(bucket)} tensors, {body.len} bytes, version {version}",
        )

    def weight_version(self) -> int:
        return int(self.transport.get("/get_weight_version")["weight_version"])

    def pause(self) -> None:
        self.transport.post_json("/pause_generation", {})

    def resume(self) -> None:
        self.transport.post_json("/continue_generation", {})

    def flush_cache(self) -> None:
        self.transport.post_json("/flush_cache", {})

    def health(self) -> bool:
        try:
            self.transport.get("/health", retry=RetryPolicy(timeout_s=5.0, max_attempts=1))
            return True
        except Exception:
            return False

    def model_info(self) -> dict:
        return self.transport.get("/get_model_info")

    def shutdown(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self.transport.close()


class _ChunkedBody:
    """A request body made of a few buffers with a known total length (so no chunked encoding)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.len = sum(memoryview(c).nbytes for c in chunks)

    def __len__(self):
        return self.len

    def __iter__(self):
        return iter(self.chunks)
