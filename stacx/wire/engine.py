"""The one interface every inference engine implements (CPU in-process, HTTP, SGLang).

The rollout driver only talks to this interface, so the same loop drives a laptop CPU engine
and an SGLang fleet:

    outputs = engine.generate(requests)            # list[GenerateOutput], same order
    engine.update_weights(buckets, version=step)   # buckets of (hf_name, tensor)
    assert engine.weight_version() == step

Asynchronous rollout (partial rollout) submits requests one by one from a driver thread and
interrupts them at a weight update:

    future = engine.submit(GenerateRequest(input_ids=..., rid="sample-17"))
    engine.pause(); engine.abort()                 # in-flight requests stop between decoding steps
    engine.update_weights(buckets, version=step); engine.resume()
    partial = future.result()                      # finish_reason "abort": the tokens so far, their
                                                   # log-probs and output_token_versions
    # continue it: stacx.rollout.continuation.continuation_request / join_outputs
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import torch

from stacx.wire.types import GenerateOutput, GenerateRequest

WeightBucket = Sequence[tuple[str, torch.Tensor]]
"""A list of (Hugging Face parameter name, full unsharded tensor)."""



class GenerationCancelled(Exception):
    """`generate(..., should_stop=...)` stopped because should_stop() returned True (its client left)."""


class InferenceEngine(abc.ABC):
    """Generation with per-token log-probs, weight updates, and lifecycle control."""

    max_concurrent_submissions: int = 256
    """Requests `submit` keeps in flight at once (one waiting thread each); more wait for a thread."""
    _submission_pool: Optional[ThreadPoolExecutor] = None
    _submission_pool_lock = threading.Lock()

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Continue each request; outputs are returned in request order. Safe to call from several
        threads at once. An aborted request's output holds what it generated before the abort
        (finish_reason "abort")."""

    def submit(self, request: GenerateRequest) -> "Future[GenerateOutput]":
        """Start one request and return at once; the future's result is its output. Thread-safe.

        The default runs `generate([request])` on one of up to `max_concurrent_submissions` threads,
        so concurrent submissions reach the engine concurrently (a server batches them)."""
        return self._submissions().submit(lambda: self.generate([request])[0])

    def abort(self, rids: Optional[Sequence[str]] = None) -> None:
        """Stop the in-flight requests with these rids (every in-flight request when None) between
        two decoding steps. Each returns through its own `generate` call or `submit` future with the
        tokens, log-probs and versions it generated so far and finish_reason "abort"; a request that
        had not started returns no tokens. Unknown or finished rids are ignored (as in SGLang)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement abort(); partial rollout needs an "
                                  "engine that does (CpuEngine, HttpEngine, SglangEngine, EnginePool)")

    def _submissions(self) -> ThreadPoolExecutor:
        with InferenceEngine._submission_pool_lock:
            if self._submission_pool is None:
                self._submission_pool = ThreadPoolExecutor(max_workers=self.max_concurrent_submissions,
                                                           thread_name_prefix=f"{type(self).__name__}-submit")
            return self._submission_pool

    def _shutdown_submissions(self) -> None:
        pool, self._submission_pool = self._submission_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Load every (hf_name, tensor) of every bucket, then serve weights tagged `version`."""

    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights the engine serves now (0 = as loaded)."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop admitting new generation requests (in-flight ones finish first, or stop at `abort`);
        paused requests wait and start after `resume`."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Admit generation requests again."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached prefixes (they were computed with older weights)."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve a request now."""

    def shutdown(self) -> None:
        """Release the engine's resources (servers, processes, `submit`'s threads). Idempotent."""
        self._shutdown_submissions()
