"""`InferenceEngine` over SGLang's native HTTP API, served by `stacx serve` (CPU) or SGLang.

Generation, pause/resume, abort (`POST /abort_request`), flush and health use SGLang's own endpoints;
`submit` runs one `/generate` per request on a client thread, so a server batches concurrent ones. Weight updates go to
`stacx serve`'s binary bucket endpoint (`/stacx/update_weights_bucket`, see weight_transfer.py);
the SGLang engine overrides `update_weights` with SGLang's tensor / distributed endpoints.

Same-host shared memory: the client asks the server for a staging file (`POST /stacx/shm_staging`
-> `{"staging_id", "path"}`), writes each bucket into it and posts only the metadata with the
`staging_id`. `shutdown()` (alias `close()`) releases and removes that file; it is safe to call twice.
"""

from __future__ import annotations

import logging
import secrets
from typing import Iterable, Optional, Sequence, Union

from stacx.parallel.tensor_buckets import TENSOR_DTYPES
from stacx.rollout.engines.server_client import ServerClient
from stacx.rollout.engines.streamed_generate import generate_streamed
from stacx.wire.engine import WeightBucket
from stacx.wire.generate_progress import STREAM_CAPABILITY
from stacx.wire.http_client import RetryPolicy, ServerRequestError
from stacx.wire.sglang_protocol import build_abort_payload, build_generate_payload, parse_generate_response
from stacx.wire.weight_versions import is_own_accepted_bucket
from stacx.wire.types import GenerateOutput, GenerateRequest
from stacx.wire.weight_transfer import (
    BUCKET_ENDPOINT, DIGEST_ENDPOINT, SHM_BUCKET_ENDPOINT, SHM_RELEASE_ENDPOINT, SHM_STAGING_ENDPOINT,
    SharedMemoryStaging, bucket_wire_chunks, numbered_buckets
)

logger = logging.getLogger(__name__)

IF_OFFERED = "if_offered"
"""`HttpEngine(stream_progress=IF_OFFERED)`: a streamed `/generate` when the server offers one (an attached
server may be `stacx serve` or SGLang)."""


def summarize_requests(requests: Sequence[GenerateRequest]) -> str:
    lengths = [len(r.input_ids) for r in requests]
    return (f"{len(requests)} sequences, prompt lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''}, "
            f"max_new_tokens {requests[0].sampling.max_new_tokens}")


class HttpEngine(ServerClient):
    """Talks to one server URL over SGLang's native API."""

    def __init__(self, url: str, retry: RetryPolicy = RetryPolicy(), *, weight_transport: str = "auto",
                 api_key: Optional[str] = None, stream_progress: Union[bool, str] = False):
        """weight_transport: 'http' sends bucket bytes in the request body; 'shm' stages them in a
        same-host shared-memory file the server creates and sends only metadata; 'auto' tries shm
        for a loopback URL and falls back to http when the server offers no staging file.
        api_key: the server's shared secret (None: `STACX_API_KEY` if set). stream_progress: True asks `stacx serve`
        for a streamed `/generate` (the tokens as they come), so a call to a server whose process died raises with
        the tokens received so far (stacx.rollout.engines.streamed_generate); the request is retried until its
        answer starts, not after. IF_OFFERED: streamed when the server says it can (`stream_offered`: asked once,
        at the first call), else unstreamed (SGLang streams another format)."""
        if stream_progress not in (True, False, IF_OFFERED):
            raise ValueError(f"HttpEngine: stream_progress must be True, False or {IF_OFFERED!r}, "
                             f"got {stream_progress!r}")
        self.stream_progress = stream_progress
        super().__init__(url, retry, api_key=api_key, weight_transport=weight_transport)
        self._shm_fallback = weight_transport == "auto"
        self._staging: SharedMemoryStaging | None = None
        self.sender = secrets.token_hex(8)
        """This client's id in every weight bucket it sends (stacx.wire.weight_versions: a retry is told from
        another sender's bucket of the same version and number)."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        if not requests:
            return []
        if self.stream_progress == IF_OFFERED:
            self.stream_progress = self.stream_offered()
        if self.stream_progress:
            return generate_streamed(self.transport, requests, summary=summarize_requests(requests))
        body = self.transport.post_json("/generate", build_generate_payload(requests), summary=summarize_requests(requests))
        return parse_generate_response(body, requests)

    def stream_offered(self) -> bool:
        """Whether the server streams `/generate` as `stacx serve` does: its `/get_model_info` names the
        capability (stacx.wire.generate_progress.STREAM_CAPABILITY); a server without the endpoint does not."""
        try:
            info = self.transport.get("/get_model_info")
        except ServerRequestError:
            return False
        return isinstance(info, dict) and info.get(STREAM_CAPABILITY) is True

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Send the buckets numbered 0, 1, ... under `version`, the last one marked final (the server
        refuses a version it serves already, or older: stacx.wire.weight_versions)."""
        for index, bucket, final in numbered_buckets(buckets):
            self._send_bucket(bucket, version=version, index=index, final=final)

    def _send_bucket(self, bucket: WeightBucket, *, version: int, index: int, final: bool) -> None:
        try:
            self._post_bucket(bucket, version=version, index=index, final=final)
        except ServerRequestError as err:
            # a retried bucket whose first attempt landed (only its answer was lost) is refused as a replay
            if err.status_code == 409 and is_own_accepted_bucket(err.answer, version=version, bucket=index,
                                                                 sender=self.sender):
                return
            raise

    def _post_bucket(self, bucket: WeightBucket, *, version: int, index: int, final: bool) -> None:
        if self.weight_transport == "shm" and self._staging is None:
            self._staging = self._open_staging()
        if self.weight_transport == "shm":
            header = self._staging.write(bucket, version=version, final=final, index=index, sender=self.sender)
            try:
                self.transport.post_json(SHM_BUCKET_ENDPOINT, header,
                                         summary=f"{len(bucket)} tensors via {self._staging.path}")
            except ServerRequestError as err:
                if err.status_code != 400 or "is not a staging file of this server" not in str(err):
                    raise
                # the server restarted (stacx.rollout.engine_health) and lost this staging file: a fresh one
                stale, self._staging = self._staging, None
                stale.close()
                self._post_bucket(bucket, version=version, index=index, final=final)
            return
        # the tensors' own memory goes to the socket; the server receives one flat buffer
        chunks = bucket_wire_chunks(bucket, version=version, final=final, index=index, sender=self.sender)
        body = _ChunkedBody(chunks)
        self.transport.request(
            "POST", BUCKET_ENDPOINT, data=body,
            summary=f"{len(bucket)} tensors, {body.len} bytes, version {version} bucket {index}",
        )

    def _open_staging(self) -> Optional[SharedMemoryStaging]:
        """Handshake for a server-created staging file. With 'auto', a server that offers none (an
        older server, another user's file, another host) switches this client to 'http'."""
        try:
            answer = self.transport.post_json(SHM_STAGING_ENDPOINT, {}, summary="shared-memory staging handshake")
            staging_id, path = answer["staging_id"], answer["path"]
        except (ServerRequestError, KeyError, TypeError) as err:
            if isinstance(err, ServerRequestError) and err.status_code in (401, 403):
                raise  # a wrong or missing API key: falling back to the body endpoint would fail the same way
            if not self._shm_fallback:
                raise RuntimeError(f"{self.url} offers no shared-memory staging file ({err}); "
                                   "use weight_transport='http'") from err
            logger.info("%s: no shared-memory staging (%s); sending weights in the request body", self.url, err)
            self.weight_transport = "http"
            return None
        try:
            return SharedMemoryStaging(path, staging_id)
        except OSError as err:
            self._release_staging(staging_id)
            if not self._shm_fallback:
                raise RuntimeError(f"cannot open the server's staging file {path} ({err}); "
                                   "use weight_transport='http'") from err
            logger.info("%s: cannot open staging file %s (%s); sending weights in the request body", self.url, path, err)
            self.weight_transport = "http"
            return None

    def _release_staging(self, staging_id: str) -> None:
        """Ask the server to remove its staging file (best effort: one short attempt)."""
        try:
            self.transport.post_json(SHM_RELEASE_ENDPOINT, {"staging_id": staging_id},
                                     retry=RetryPolicy(timeout_s=5.0, max_attempts=1))
        except Exception as err:  # noqa: BLE001 - teardown goes on; the server removes it when it stops
            logger.debug("releasing staging file %s on %s failed: %s", staging_id, self.url, err)

    def abort(self, rids: Optional[Sequence[str]] = None) -> None:
        """`POST /abort_request`: `{"abort_all": true}` when rids is None, else one `{"rid": ...}` per rid."""
        for rid in [None] if rids is None else list(rids):
            self.transport.post_json("/abort_request", build_abort_payload(rid),
                                     summary="abort every request" if rid is None else f"abort request {rid}")

    def weight_version(self) -> int:
        return int(self.transport.get("/get_weight_version")["weight_version"])

    def _digest_answer(self, names: Sequence[str]) -> Optional[dict]:
        """`stacx serve`'s digest answer; None from a server without the endpoint (another SGLang-API server)."""
        try:
            return self.transport.post_json(DIGEST_ENDPOINT, {"names": list(names)}, summary=f"{len(names)} digests")
        except ServerRequestError as err:
            if err.status_code == 404:
                return None
            raise

    def weight_digests(self, names: Sequence[str]) -> dict:
        """{name: digest or None (unverified)} of the served weights (stacx.rollout.weight_check)."""
        answer = self._digest_answer(names)
        return answer["digests"] if answer is not None else {name: None for name in names}

    def weight_digest_dtype(self):
        """The served weights' dtype: the sender digests floating tensors cast to it (None: unknown)."""
        answer = self._digest_answer([])
        return TENSOR_DTYPES[answer["dtype"]] if answer is not None else None

    def pause(self) -> None:
        self.transport.post_json("/pause_generation", {})

    def resume(self) -> None:
        self.transport.post_json("/continue_generation", {})

    def flush_cache(self) -> None:
        self.transport.post_json("/flush_cache", {})

    def model_info(self) -> dict:
        return self.transport.get("/get_model_info")

    def shutdown(self) -> None:
        """Remove the shared-memory staging file (here and on the server) and close the connection.
        Safe to call twice."""
        staging, self._staging = self._staging, None
        self._shutdown_submissions()
        try:
            if staging is not None:
                self._release_staging(staging.staging_id)
        finally:
            if staging is not None:
                staging.close()
            self.transport.close()

    close = shutdown


class _ChunkedBody:
    """A request body made of a few buffers with a known total length (so no chunked encoding)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.len = sum(memoryview(c).nbytes for c in chunks)

    def __len__(self):
        return self.len

    def __iter__(self):
        return iter(self.chunks)
