"""The benchmark's rollout modes over the cost-model engine: sync (today's loop) and async under Stacx's scheduler.

sync            per step: generate B groups, wait for all, train, update the engine's weights
async K         a producer thread keeps the engine fed as far as `AsyncRolloutScheduler` admits;
                the trainer takes the oldest complete groups within the staleness bound K
                drain     at an update, admission stops and the in-flight groups finish first
                partial   at an update, in-flight groups are aborted, kept and continued under the
                          new weights (their tokens so far keep their old versions)

Every mode runs `steps` steps of B groups of n samples over the same workload and reports, over
the steps after `warmup` (the pipeline filling up is not the steady state):
samples/s, trainer idle fraction (not in an optimizer step), engine idle fraction (no request
running), and per weight update the stall (from the update request until the engine serves the
new version: it takes no new work meanwhile) and the decode capacity idle in it (integral of
1 - running / (B x n), a full batch's width: a drain that decodes a 2-request tail at full step
cost is nearly idle).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from engine_model import CostModel, CostModelEngine, Request, Workload, busy_seconds, slot_idle_seconds, wait_limit_s

from stacx.rollout.asynchronous.async_scheduler import AsyncRolloutConfig, AsyncRolloutScheduler


@dataclass(frozen=True, kw_only=True)
class RunShape:
    groups_per_step: int = 8
    samples_per_group: int = 4
    steps: int = 14
    warmup: int = 2


@dataclass
class ModeResult:
    mode: str
    samples_per_s: float
    trainer_idle_frac: float
    engine_idle_frac: float
    update_stall_s: float
    """Mean per update: from the update request until the engine serves the new version."""
    update_slot_idle_s: float
    """Mean per update: decode capacity left unused in that window, in seconds of a full batch's width (B x n requests)."""
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    off_policy_token_frac: float = 0.0
    resumed_prefill_tokens: int = 0
    rollout_median_s: float = 0.0
    """sync only: the median time to generate one step's batch."""
    batches: list[list[int]] = field(default_factory=list)
    """Prompts of each step's batch, in batch order."""

    def row(self) -> dict:
        out = dict(self.__dict__)
        out.pop("batches")
        return out


class _Timeline:
    """What the trainer did when: training intervals and weight-update windows, and each step's end."""

    def __init__(self):
        self.train: list[tuple[float, float]] = []
        self.updates: list[tuple[float, float]] = []  # from the update request to the new version served
        self.step_ends: list[float] = []

    def result(self, mode: str, engine: CostModelEngine, shape: RunShape, **extra) -> ModeResult:
        start, end = self.step_ends[shape.warmup - 1], self.step_ends[-1]
        wall = end - start
        trained = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.train)
        updates = [(a, b) for a, b in self.updates if a >= start]
        stall = sum(b - a for a, b in updates) / len(updates)
        width = shape.groups_per_step * shape.samples_per_group
        slot_idle = sum(slot_idle_seconds(engine.steps, a, b, width) for a, b in updates) / len(updates)
        samples = (len(self.step_ends) - shape.warmup) * shape.groups_per_step * shape.samples_per_group
        return ModeResult(mode=mode, samples_per_s=samples / wall, trainer_idle_frac=1 - trained / wall,
                          engine_idle_frac=1 - busy_seconds(engine.steps, start, end) / wall,
                          update_stall_s=stall, update_slot_idle_s=slot_idle,
                          resumed_prefill_tokens=engine.resumed_prefill_tokens, **extra)

    def train_step(self, cost: CostModel) -> None:
        begin = time.monotonic()
        cost.sleep(cost.train_step_s)
        self.train.append((begin, time.monotonic()))


def new_requests(workload: Workload, group_id: int, prompt: int, samples: int) -> list[Request]:
    return [Request(group_id, prompt, j, workload.prompt_len, workload.response_len(prompt, j)) for j in range(samples)]


def run_sync(cost: CostModel, workload: Workload, shape: RunShape) -> ModeResult:
    """Today's loop: the engine generates a whole batch, then the trainer trains, then the weights move."""
    finished = threading.Semaphore(0)
    engine = CostModelEngine(cost, lambda request: finished.release())
    timeline, batches, rollout_s = _Timeline(), [], []
    try:
        for step in range(shape.steps):
            begin = time.monotonic()
            prompts = list(range(step * shape.groups_per_step, (step + 1) * shape.groups_per_step))
            for prompt in prompts:
                for request in new_requests(workload, prompt, prompt, shape.samples_per_group):
                    engine.submit(request)
            for _ in range(len(prompts) * shape.samples_per_group):
                assert finished.acquire(timeout=wait_limit_s(cost)), "the engine stopped finishing requests"
            rollout_s.append(time.monotonic() - begin)
            batches.append(prompts)
            timeline.train_step(cost)
            begin = time.monotonic()
            engine.update_weights(step + 1)
            timeline.updates.append((begin, time.monotonic()))
            timeline.step_ends.append(time.monotonic())
    finally:
        engine.close()
    return timeline.result("sync", engine, shape, batches=batches, rollout_median_s=statistics.median(rollout_s),
                           staleness_histogram={0: shape.steps * shape.groups_per_step})


class _Groups:
    """Per group, its finished responses; reports the group to the scheduler when all n are in."""

    def __init__(self, scheduler: AsyncRolloutScheduler, samples: int):
        self.scheduler, self.samples = scheduler, samples
        self._lock = threading.Lock()
        self._done: dict[int, list[Request]] = {}

    def open(self, group_id: int) -> None:
        with self._lock:
            self._done[group_id] = []

    def on_done(self, request: Request) -> None:
        with self._lock:
            done = self._done[request.group_id]
            done.append(request)
            if len(done) < self.samples:
                return
            del self._done[request.group_id]
        responses = sorted(done, key=lambda r: r.sample)
        self.scheduler.complete(request.group_id, responses, [r.versions for r in responses])


def run_async(cost: CostModel, workload: Workload, shape: RunShape, *, max_staleness: int, partial: bool) -> ModeResult:
    """A producer thread feeds the engine as the scheduler admits; the trainer takes batches and updates the weights."""
    scheduler = AsyncRolloutScheduler(AsyncRolloutConfig(
        max_staleness=max_staleness, groups_per_step=shape.groups_per_step,
        samples_per_group=shape.samples_per_group, partial_rollout=partial))
    groups = _Groups(scheduler, shape.samples_per_group)
    engine = CostModelEngine(cost, groups.on_done)
    # Admission and submission are one act for the trainer: it opens an update window only between
    # two of them, so every admitted group's requests are already on the engine when it aborts or drains.
    submit_lock = threading.Lock()
    errors: list[BaseException] = []

    def produce() -> None:
        prompt = 0
        try:
            while scheduler.wait_for_work():
                with submit_lock:
                    continuation = scheduler.pop_continuation()
                    if continuation is not None:
                        for request in continuation.state:
                            engine.submit(request)
                        continue
                    group_id = scheduler.admit(prompt)
                    if group_id is None:
                        continue  # an update window opened: this prompt is admitted next
                    groups.open(group_id)
                    for request in new_requests(workload, group_id, prompt, shape.samples_per_group):
                        engine.submit(request)
                prompt += 1
        except BaseException as error:  # reported by the trainer thread
            errors.append(error)

    producer = threading.Thread(target=produce, name="producer", daemon=True)
    producer.start()
    timeline, batches = _Timeline(), []
    try:
        for step in range(shape.steps):
            batch = scheduler.take_batch(step, timeout=wait_limit_s(cost))
            assert batch is not None and not errors, errors or "no batch: the schedule is stuck"
            batches.append([g.payload for g in batch.groups])
            timeline.train_step(cost)
            begin = time.monotonic()
            with submit_lock:
                scheduler.begin_update()
            if partial:
                unfinished: dict[int, list[Request]] = {}
                for request in engine.abort_all():
                    unfinished.setdefault(request.group_id, []).append(request)
                for group_id, requests in sorted(unfinished.items()):
                    scheduler.interrupt(group_id, requests)
            else:
                assert scheduler.wait_until_drained(timeout=wait_limit_s(cost)), "the engine did not drain"
            engine.update_weights(step + 1)
            scheduler.publish_version(step + 1)
            timeline.updates.append((begin, time.monotonic()))
            timeline.step_ends.append(time.monotonic())
    finally:
        scheduler.close()
        producer.join(timeout=10)
        engine.close()
    name = f"async K={max_staleness} " + ("partial" if partial else "drain")
    return timeline.result(name, engine, shape, batches=batches,
                           staleness_histogram=scheduler.staleness_histogram(),
                           off_policy_token_frac=scheduler.metrics()["async/off_policy_token_frac_total"])
