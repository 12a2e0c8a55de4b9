"""Several rollout servers behind one `InferenceEngine`: requests spread, weights pushed to all.

    pool = EnginePool([HttpEngine(u) for u in rollout_urls])
    outputs = pool.generate(requests)     # split into one chunk per engine, sent concurrently
    pool.pause(); ...; pool.resume()      # every engine
    pool.weight_versions()                # {url: version}, one per engine

Spreading: a call's requests are cut into `len(engines)` contiguous chunks of nearly equal total
token count (prompt + max_new_tokens), and each chunk goes to the engine with the fewest requests
in flight at that moment (ties: the engine that has received the fewest requests overall), so
concurrent callers (rollout, evaluation, roll-in turns for student and teacher) share the fleet.
Outputs come back in request order. `requests_sent` counts the requests each engine received.

Failures (`supervisor`, stacx.rollout.engine_health): with a supervisor the pool dispatches to live
engines only, re-issues the requests of an engine that failed to a live one, and its lifecycle calls
(pause, flush, resume, versions) go to the engines a weight push reaches; without one, any failure is raised.

Weights are not streamed through the pool: the trainer's ranks stream the buckets to every URL
(`StacxTrainer.push_policy_weights`); the pool pauses, flushes, resumes and version-checks each.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

from stacx.rollout.continuation import continuation_request
from stacx.rollout.engine_health import EngineFailed, EngineSupervisor
from stacx.rollout.salvage import can_salvage, joined, salvaged
from stacx.wire.engine import InferenceEngine, WeightBucket
from stacx.wire.types import GenerateOutput, GenerateRequest


def split_balanced(requests: Sequence[GenerateRequest], num_chunks: int) -> list[list[int]]:
    """Contiguous index chunks (at most `num_chunks`, none empty) of nearly equal token cost."""
    costs = [len(r.input_ids) + r.sampling.max_new_tokens for r in requests]
    total = sum(costs)
    chunks: list[list[int]] = [[]]
    done = 0
    for index, cost in enumerate(costs):
        # Start a new chunk once this one holds its share of the total.
        share = total * len(chunks) / num_chunks
        if chunks[-1] and done >= share and len(chunks) < num_chunks:
            chunks.append([])
        chunks[-1].append(index)
        done += cost
    return chunks


class EnginePool(InferenceEngine):
    """Least-loaded dispatch over several engines; lifecycle calls go to every engine."""

    def __init__(self, engines: Sequence[InferenceEngine], names: Sequence[str] | None = None, *,
                 supervisor: Optional[EngineSupervisor] = None):
        """supervisor: notices failed engines and restarts or sets them aside (its `engines` must be this
        pool's list: `EngineSupervisor(pool.engines, ...)` after building the pool, or `supervise`)."""
        if not engines:
            raise ValueError("EnginePool needs at least one engine (rollout_urls is empty)")
        self.engines = list(engines)
        self.names = list(names) if names is not None else [getattr(e, "url", f"engine {i}") for i, e in enumerate(engines)]
        self.in_flight = [0] * len(self.engines)
        self.requests_sent = [0] * len(self.engines)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.engines)), thread_name_prefix="engine-pool")
        self.supervisor = supervisor

    def supervise(self, **kwargs) -> EngineSupervisor:
        """Attach an `EngineSupervisor(self.engines, names=self.names, **kwargs)` and return it."""
        self.supervisor = EngineSupervisor(self.engines, names=self.names, **kwargs)
        return self.supervisor

    def _acquire(self, num_requests: int) -> int:
        candidates = self.supervisor.live() if self.supervisor is not None else range(len(self.engines))
        with self._lock:
            index = min(candidates, key=lambda i: (self.in_flight[i], self.requests_sent[i], i))
            self.in_flight[index] += num_requests
            self.requests_sent[index] += num_requests
            return index

    def _release(self, index: int, num_requests: int) -> None:
        with self._lock:
            self.in_flight[index] -= num_requests

    def _generate_on_least_loaded(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        while True:
            index = self._acquire(len(requests))
            engine = self.engines[index]
            partial = None
            try:
                if self.supervisor is None:
                    return engine.generate(requests)
                # requests with rids can be aborted on a stalled engine, keeping their tokens (stacx.rollout.salvage)
                salvage = (lambda: engine.abort([r.rid for r in requests])) if can_salvage(requests) else None
                return self.supervisor.call(index, lambda: engine.generate(requests), salvage=salvage,
                                            client=engine)
            except EngineFailed as failed:  # set aside by the supervisor: the requests go to a live engine
                self.supervisor.requests_reissued += len(requests)
                partial = failed.partial
            finally:
                self._release(index, len(requests))
            if partial is not None:
                return self._continue_salvaged(requests, partial)

    def _continue_salvaged(self, requests: list[GenerateRequest], partial: list[GenerateOutput]) -> list[GenerateOutput]:
        """A failed engine's aborted outputs continued on a live engine from their tokens, joined."""
        kept = salvaged(requests, partial)
        if not kept:
            return list(partial)
        self.supervisor.tokens_salvaged += sum(len(output.output_ids) for output in kept.values())
        continued = self._generate_on_least_loaded([continuation_request(requests[i], out) for i, out in kept.items()])
        return joined(partial, kept, continued)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        if not requests:
            return []
        chunks = split_balanced(requests, len(self.engines))
        if len(chunks) == 1:
            return self._generate_on_least_loaded(list(requests))
        futures = [self._pool.submit(self._generate_on_least_loaded, [requests[i] for i in chunk]) for chunk in chunks]
        outputs: list[GenerateOutput | None] = [None] * len(requests)
        for chunk, future in zip(chunks, futures):
            for index, output in zip(chunk, future.result()):
                outputs[index] = output
        return outputs  # type: ignore[return-value]

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Materializes the buckets once and sends them to every engine (in-process use; the trainer
        streams to each URL from its ranks instead)."""
        materialized = [list(bucket) for bucket in buckets]
        for engine in self.engines:
            engine.update_weights(iter(materialized), version=version)

    def abort(self, rids: Optional[Sequence[str]] = None) -> None:
        """Abort on every engine (a rid is in flight on at most one of them; the others ignore it)."""
        if self.supervisor is not None:
            self.supervisor.each("abort", lambda engine: engine.abort(rids), self.supervisor.live())
            return
        for engine in self.engines:
            engine.abort(rids)

    def weight_versions(self) -> dict[str, int]:
        if self.supervisor is not None:  # the engines the last push reached
            served = self.supervisor.each("reading the weight version", lambda engine: engine.weight_version(),
                                          self.supervisor.updated_engines())
            return {self.names[index]: version for index, version in served.items()}
        return {name: engine.weight_version() for name, engine in zip(self.names, self.engines)}

    def weight_version(self) -> int:
        """The lowest version any engine serves (all equal after a successful update)."""
        return min(self.weight_versions().values())

    def pause(self) -> None:
        """Pauses every engine. If any fails, the ones already paused are resumed (so no engine is
        left paused by a half-done pause) and one error names every engine that failed. With a supervisor,
        an engine that fails is set aside (restarted when it can be) and the others are paused."""
        if self.supervisor is not None:
            self.supervisor.begin_update()
            self.supervisor.each("pause", lambda engine: engine.pause())
            return
        paused, errors = [], []
        for name, engine in zip(self.names, self.engines):
            try:
                engine.pause()
                paused.append((name, engine))
            except Exception as err:  # noqa: BLE001 - try every engine before reporting
                errors.append(f"{name}: {err}")
        if not errors:
            return
        for name, engine in paused:
            try:
                engine.resume()
            except Exception as err:  # noqa: BLE001 - a failed undo is reported with the pause errors
                errors.append(f"{name} (resuming after the failed pause): {err}")
        raise RuntimeError("pausing rollout engines failed: " + "; ".join(errors))

    def resume(self) -> None:
        if self.supervisor is not None:
            self.supervisor.each("resume", lambda engine: engine.resume())
            return
        errors = []
        for name, engine in zip(self.names, self.engines):
            try:
                engine.resume()
            except Exception as err:  # noqa: BLE001 - resume every engine before reporting
                errors.append(f"{name}: {err}")
        if errors:
            raise RuntimeError("resuming rollout engines failed: " + "; ".join(errors))

    def flush_cache(self) -> None:
        if self.supervisor is not None:
            self.supervisor.each("flush", lambda engine: engine.flush_cache())
            return
        for engine in self.engines:
            engine.flush_cache()

    def health(self) -> bool:
        return all(engine.health() for engine in self.engines)

    def shutdown(self) -> None:
        self._shutdown_submissions()
        self._pool.shutdown(wait=False)
        if self.supervisor is not None:
            self.supervisor.shutdown()
        for engine in self.engines:
            engine.shutdown()
