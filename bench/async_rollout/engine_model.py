"""A cost-model inference engine for the asynchronous rollout benchmark: time comes from sleeps, not math.

Like a continuous-batching engine, it runs every admitted request in one decode step per token:
a step costs `decode_step_s` (+ `decode_per_seq_s` per running request) whatever the batch holds,
so a batch reduced to its long tail costs as much per step as a full one. Requests that join are
prefilled first (`prefill_token_s` per token, their prompt plus any tokens they already carry).
Each generated token records the weight version that produced it. `abort_all` stops at a step
boundary and hands back every unfinished request with its tokens so far; resubmitting one
continues it (after a new prefill). `update_weights` needs an empty engine.

Self-contained on purpose: this is a stand-in with its own small interface, not Stacx's engine
protocol. Every sleep is multiplied by `CostModel.time_scale` (0 in the tests).
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Seconds per unit of engine and trainer work."""

    decode_step_s: float = 0.002
    """One decode step of the whole running batch (memory-bound: about constant in the batch size)."""
    decode_per_seq_s: float = 0.000005
    """Added to a decode step per running request."""
    prefill_token_s: float = 0.00001
    """Per prompt token prefilled (and per carried token when a request is continued)."""
    weight_update_s: float = 0.03
    """Loading a new version into the engine (it serves nothing meanwhile)."""
    train_step_s: float = 0.8
    """The trainer stand-in's optimizer step over one batch."""
    max_running: int = 512
    """Requests decoded at once; more wait in the engine's queue."""
    time_scale: float = 1.0
    """Multiplies every sleep (0: no sleeps, for tests)."""

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds * self.time_scale)


Z_99 = statistics.NormalDist().inv_cdf(0.99)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Prompts of a fixed length; response lengths log-normal with p99 = `p99_over_median` x the median."""

    prompt_len: int = 128
    median_response_len: int = 30
    p99_over_median: float = 10.0
    max_response_len: int = 480
    """Cut-off (a real run's max_new_tokens); 16x the median cuts about 0.3% of responses."""
    seed: int = 0

    @property
    def sigma(self) -> float:
        return math.log(self.p99_over_median) / Z_99

    def response_len(self, prompt: int, sample: int) -> int:
        """The same length for (prompt, sample) in every mode: the modes see one workload."""
        rng = random.Random(f"{self.seed}/{prompt}/{sample}")
        length = rng.lognormvariate(math.log(self.median_response_len), self.sigma)
        return max(1, min(self.max_response_len, round(length)))


@dataclass
class Request:
    """One response being generated: `versions[i]` is the weight version of its i-th token."""

    group_id: int
    prompt: int
    sample: int
    prompt_len: int
    target_len: int
    versions: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.versions) >= self.target_len


@dataclass(frozen=True)
class StepRecord:
    start: float
    end: float
    running: int
    kind: str  # "prefill" or "decode"
    version: int


class CostModelEngine:
    """A thread that decodes every running request once per step; `on_done(request)` runs per finished request."""

    def __init__(self, cost: CostModel, on_done: Callable[[Request], None], version: int = 0):
        self.cost, self.on_done, self.version = cost, on_done, version
        self._cond = threading.Condition()
        self._queue: list[Request] = []
        self._running: list[Request] = []
        self._paused = False
        self._stepping = False
        self._closed = False
        self._clock: float | None = None
        self.steps: list[StepRecord] = []
        self.resumed_prefill_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="cost-model-engine", daemon=True)
        self._thread.start()

    # ---- interface -----------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._cond:
            self._queue.append(request)
            self._cond.notify_all()

    def abort_all(self) -> list[Request]:
        """Pause at the next step boundary and return every unfinished request (running and queued)."""
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._stepping)
            out, self._running, self._queue = self._running + self._queue, [], []
            return out

    def num_unfinished(self) -> int:
        with self._cond:
            return len(self._running) + len(self._queue)

    def update_weights(self, version: int) -> None:
        """Load `version`: waits for the step in progress, then sleeps `weight_update_s`; resumes afterwards."""
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._stepping)
            assert not self._running and not self._queue, "update_weights needs an empty engine (abort or drain first)"
        start = time.monotonic()
        self.cost.sleep(self.cost.weight_update_s)
        with self._cond:
            self.steps.append(StepRecord(start, time.monotonic(), 0, "update", version))
            self.version = version
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ---- the engine thread ---------------------------------------------------------------------

    def _ready(self) -> bool:
        return self._closed or (not self._paused and bool(self._queue or self._running))

    def _spend(self, seconds: float) -> None:
        """Advance the engine's clock by `seconds` of work and sleep until it: a late wake-up on a busy
        host is made up by the next step's shorter sleep, so the engine keeps the cost model's pace."""
        self._clock += seconds * self.cost.time_scale
        delay = self._clock - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._ready():
                    self._clock = None  # idle time is not owed
                    self._cond.wait_for(self._ready)
                if self._closed:
                    return
                self._stepping = True
                joining = self._queue[: max(0, self.cost.max_running - len(self._running))]
                del self._queue[: len(joining)]
                self._running += joining
                running, version = list(self._running), self.version
            if self._clock is None:
                self._clock = time.monotonic()
            finished = self._step(joining, running, version)
            for request in finished:
                self.on_done(request)
            with self._cond:
                self._stepping = False
                self._cond.notify_all()

    def _step(self, joining: list[Request], running: list[Request], version: int) -> list[Request]:
        if joining:
            tokens = sum(r.prompt_len + len(r.versions) for r in joining)
            self.resumed_prefill_tokens += sum(len(r.versions) for r in joining)
            start = time.monotonic()
            self._spend(self.cost.prefill_token_s * tokens)
            self.steps.append(StepRecord(start, time.monotonic(), len(running), "prefill", version))
        start = time.monotonic()
        self._spend(self.cost.decode_step_s + self.cost.decode_per_seq_s * len(running))
        for request in running:
            request.versions.append(version)
        self.steps.append(StepRecord(start, time.monotonic(), len(running), "decode", version))
        finished = [r for r in running if r.done]
        if finished:
            with self._cond:
                self._running = [r for r in self._running if not r.done]
        return finished


def busy_seconds(steps: list[StepRecord], start: float, end: float) -> float:
    """Time in [start, end] during which the engine ran a prefill or decode step."""
    return sum(max(0.0, min(s.end, end) - max(s.start, start)) for s in steps if s.kind != "update")


def slot_idle_seconds(steps: list[StepRecord], start: float, end: float, slots: int) -> float:
    """Integral over [start, end] of (1 - running / slots): decode capacity left unused, in seconds."""
    if slots <= 0:
        return end - start
    used = sum(max(0.0, min(s.end, end) - max(s.start, start)) * min(s.running, slots) / slots
               for s in steps if s.kind != "update")
    return (end - start) - used


def wait_limit_s(cost: CostModel) -> float:
    """How long a driver waits for anything before calling the run stuck."""
    return 60.0 + 600.0 * cost.time_scale
