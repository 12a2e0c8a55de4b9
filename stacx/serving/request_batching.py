"""Concurrent `generate` calls coalesced into one engine call (what `stacx serve` puts in front of its engine).

    batcher = GenerateBatcher(engine)
    outputs = batcher.generate(requests, should_stop=client_gone)   # from any number of threads

The CPU engine decodes a list of requests as one batch (one forward per step for every active
row), but serves one call at a time: without this, N clients each sending one prompt run N
batches of one, back to back. Here every call that arrives while a batch runs waits in a queue;
when the batch ends, the first waiting caller becomes the leader, takes every queued submission
(in arrival order, up to `max_batch_requests` requests; a submission is never split), runs them
as ONE `engine.generate`, and hands each submission its own slice of the outputs.

- Each submission's requests are validated before it queues (`engine.check_requests`), so a bad
  request fails its own caller only.
- A queued caller whose `should_stop()` turns True leaves the queue with `GenerationCancelled`.
  Once its requests are in a running batch they finish with the batch; the batch itself stops
  (every caller in it gets `GenerationCancelled`) only when every caller in it has stopped.
- An engine error fails every caller of that batch with the same exception.
- Abort: a submission's requests carry abort flags (`abort_flags`, else registered here with an
  engine that keeps an `aborts` book), passed with the batch to the engine, which stops each
  flagged request between decoding steps; the rest of the batch goes on.
Seeded requests draw from their own generators, so batching does not change their samples.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Optional, Sequence

from stacx.wire.engine import GenerationCancelled


class _Submission:
    def __init__(self, requests: list, should_stop: Optional[Callable[[], bool]], abort_flags: Optional[list]):
        self.requests = requests
        self.should_stop = should_stop
        self.abort_flags = abort_flags
        self.outputs: Optional[list] = None
        self.error: Optional[BaseException] = None
        self.done = False

    def stopped(self) -> bool:
        return self.should_stop is not None and bool(self.should_stop())


class GenerateBatcher:
    """`generate(requests, should_stop=None)` with the engine's signature, batching concurrent callers."""

    def __init__(self, engine: Any, *, max_batch_requests: int = 256):
        if max_batch_requests < 1:
            raise ValueError(f"max_batch_requests must be >= 1, got {max_batch_requests}")
        self.engine = engine
        self.max_batch_requests = max_batch_requests
        self._engine_cancels = _accepts(engine, "should_stop")
        self._engine_aborts = _accepts(engine, "abort_flags")
        self._condition = threading.Condition()
        self._queue: list[_Submission] = []
        self._running = False
        self.num_engine_calls = 0
        """Engine calls made so far (fewer than the callers when requests were batched)."""

    def generate(self, requests: Sequence[Any], *, should_stop: Optional[Callable[[], bool]] = None,
                 abort_flags: Optional[Sequence[Any]] = None) -> list:
        """abort_flags: one `AbortFlag` per request (registered by the caller); None registers them
        here for the time of the call when the engine keeps an `aborts` book."""
        check = getattr(self.engine, "check_requests", None)
        if check is not None:
            check(list(requests))
        book = getattr(self.engine, "aborts", None) if self._engine_aborts else None
        if abort_flags is None and book is not None:
            flags = book.register([getattr(r, "rid", None) for r in requests])
            try:
                return self.generate(requests, should_stop=should_stop, abort_flags=flags)
            finally:
                book.release(flags)
        if abort_flags is not None and len(abort_flags) != len(requests):
            raise ValueError(f"generate: {len(abort_flags)} abort_flags for {len(requests)} requests")
        submission = _Submission(list(requests), should_stop, None if abort_flags is None else list(abort_flags))
        with self._condition:
            self._queue.append(submission)
        while True:
            with self._condition:
                while self._running and not submission.done:
                    self._condition.wait(timeout=0.1)
                    if submission in self._queue and submission.stopped():
                        self._queue.remove(submission)
                        raise GenerationCancelled("the caller stopped waiting for the engine")
                if submission.done:
                    return self._result(submission)
                self._running = True  # this caller leads the next batch
                batch = self._take_batch()
            try:
                self._run(batch)
            finally:
                with self._condition:
                    self._running = False
                    self._condition.notify_all()

    def _take_batch(self) -> list[_Submission]:
        """Queued submissions from the front, whole, up to max_batch_requests requests (at least one)."""
        batch, size = [], 0
        while self._queue and (not batch or size + len(self._queue[0].requests) <= self.max_batch_requests):
            submission = self._queue.pop(0)
            batch.append(submission)
            size += len(submission.requests)
        return batch

    def _run(self, batch: list[_Submission]) -> None:
        requests = [request for submission in batch for request in submission.requests]
        self.num_engine_calls += 1
        options: dict = {}
        if self._engine_cancels:
            options["should_stop"] = lambda: all(s.stopped() for s in batch)
        if self._engine_aborts and all(s.abort_flags is not None for s in batch):
            options["abort_flags"] = [flag for s in batch for flag in s.abort_flags]
        try:
            outputs = self.engine.generate(requests, **options)
        except BaseException as error:  # noqa: BLE001 - handed to every caller of the batch
            for submission in batch:
                submission.error, submission.done = error, True
            return
        start = 0
        for submission in batch:
            submission.outputs = outputs[start: start + len(submission.requests)]
            submission.done = True
            start += len(submission.requests)

    @staticmethod
    def _result(submission: _Submission) -> list:
        if submission.error is not None:
            raise submission.error
        return submission.outputs


def _accepts(engine: Any, option: str) -> bool:
    return engine is not None and option in inspect.signature(engine.generate).parameters
