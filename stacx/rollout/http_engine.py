"""`InferenceEngine` over SGLang's native HTTP API, served by `stacx serve` (CPU) or SGLang.

Generation, pause/resume, flush and health use SGLang's own endpoints. Weight updates go to
`stacx serve`'s binary bucket endpoint (`/stacx/update_weights_bucket`, see weight_transfer.py);
the SGLang engine overrides `update_weights` with SGLang's tensor / distributed endpoints.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from stacx.rollout.engine import InferenceEngine, WeightBucket
from stacx.rollout.http_client import HttpTransport, RetryPolicy
from stacx.rollout.sglang_protocol import build_generate_payload, parse_generate_response
from stacx.rollout.types import GenerateOutput, GenerateRequest
from stacx.rollout.weight_transfer import encode_bucket_header, flatten_bucket

BUCKET_ENDPOINT = "/stacx/update_weights_bucket"


def summarize_requests(requests: Sequence[GenerateRequest]) -> str:
    lengths = [len(r.input_ids) for r in requests]
    return (f"{len(requests)} sequences, prompt lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''}, "
            f"max_new_tokens {requests[0].sampling.max_new_tokens}")


class HttpEngine(InferenceEngine):
    """Talks to one server URL."""

    def __init__(self, url: str, retry: RetryPolicy = RetryPolicy()):
        self.transport = HttpTransport(url, retry)

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
        flat = flatten_bucket(bucket)
        header = encode_bucket_header(flat, version=version, final=final)
        # header + raw bytes sent as two chunks: the tensor bytes are not copied into a new buffer
        body = [header, memoryview(flat.data.numpy())]
        self.transport.request(
            "POST", BUCKET_ENDPOINT, data=_ChunkedBody(body), summary=f"{len(flat.names)} tensors, {flat.num_bytes} bytes, version {version}",
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
