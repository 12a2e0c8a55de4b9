"""The asynchronous rollout scheduler: the staleness bound, nothing lost or duplicated, oldest first,
K = 0 equal to the synchronous schedule, over thousands of seeded random schedules (pure Python)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from stacx.rollout.asynchronous.async_scheduler import AsyncRolloutConfig, AsyncRolloutScheduler, admission_capacity


class RandomSchedule:
    """One random interleaving of producer, engine and trainer events, driven against a scheduler.

    The engine generates tokens one at a time for random running groups and finishes them in random
    order; the trainer takes a batch whenever it can, trains for a random while (the engine keeps
    generating), then updates: with partial rollout it interrupts a random subset of the running
    groups and waits for the rest to finish, without it it drains them all; then it publishes the
    next version. Every observation is checked against the harness's own records.
    """

    def __init__(self, seed: int, *, max_staleness: int, groups_per_step: int, partial: bool, samples: int = 2):
        self.rng = random.Random(seed)
        self.k, self.b, self.partial, self.samples = max_staleness, groups_per_step, partial, samples
        self.scheduler = AsyncRolloutScheduler(AsyncRolloutConfig(
            max_staleness=max_staleness, groups_per_step=groups_per_step, samples_per_group=samples,
            partial_rollout=partial))
        self.engine_version = 0
        self.running: dict[int, list[list[int]]] = {}  # group -> per response, its tokens' versions
        self.complete: set[int] = set()
        self.admit_version: dict[int, int] = {}
        self.prompt_of: dict[int, int] = {}
        self.trained: list[int] = []
        self.batches: list[list[int]] = []  # prompts per step
        self.phase = "take"  # take -> train -> update -> take ...
        self.step = 0

    def run(self, steps: int) -> "RandomSchedule":
        while self.step < steps:
            actions = self.enabled_actions()
            assert actions, self.deadlock_report()
            getattr(self, self.rng.choice(actions))()
        return self

    def enabled_actions(self) -> list[str]:
        actions = []
        if self.scheduler.can_admit():
            actions += ["admit"] * 2
        if self.running:
            actions += ["token"] * 4 + ["finish"]
        if self.phase in ("take", "train"):
            actions.append(self.phase)
        if self.phase == "update" and not self.running:
            actions.append("publish")
        actions.append("continue_interrupted")
        if actions == ["take", "continue_interrupted"] and not self.has_continuations():
            # Only the trainer can move: taking must succeed, or the schedule is stuck.
            return ["take"]
        return actions

    def has_continuations(self) -> bool:
        return self.scheduler.counts()["interrupted"] > 0 and self.phase != "update"

    # producer and engine
    def admit(self):
        group = self.scheduler.admit(len(self.prompt_of))
        self.prompt_of[group] = len(self.prompt_of)
        self.admit_version[group] = self.scheduler.policy_version
        self.running[group] = [[] for _ in range(self.samples)]

    def continue_interrupted(self):
        continuation = self.scheduler.pop_continuation()
        if continuation is not None:
            self.running[continuation.group_id] = continuation.state

    def token(self):
        group = self.rng.choice(sorted(self.running))
        self.rng.choice(self.running[group]).append(self.engine_version)

    def finish(self):
        group = self.rng.choice(sorted(self.running))
        self.scheduler.complete(group, f"responses of {group}", self.running.pop(group))
        self.complete.add(group)

    # trainer
    def take(self):
        oldest_complete = sorted(self.complete)[: self.b]
        oldest_unconsumed = self.scheduler.unconsumed_group_ids()[: self.b]
        batch = self.scheduler.take_batch(self.step, timeout=0)
        if batch is None:
            # It waits only while one of the B oldest unconsumed groups is unfinished.
            assert not set(oldest_unconsumed) <= self.complete or len(oldest_unconsumed) < self.b
            return
        ids = [g.group_id for g in batch.groups]
        assert ids == oldest_complete, "a batch is the B oldest complete groups, oldest first"
        for group in batch.groups:
            assert group.group_id not in self.trained, f"group {group.group_id} trained twice"
            assert group.payload == self.prompt_of[group.group_id]
            oldest = min(group.version_tokens, default=self.admit_version[group.group_id])
            assert oldest >= self.admit_version[group.group_id]
            assert self.step - oldest <= self.k, f"group {group.group_id} trained {self.step - oldest} versions late"
        self.trained += ids
        self.complete -= set(ids)
        self.batches.append([g.payload for g in batch.groups])
        self.phase = "train"

    def train(self):
        self.phase = "update"
        self.scheduler.begin_update()
        if self.partial:
            for group in sorted(self.running):
                if self.rng.random() < 0.7:
                    self.scheduler.interrupt(group, self.running.pop(group))

    def publish(self):
        self.engine_version = self.step + 1
        self.scheduler.publish_version(self.step + 1)
        self.step += 1
        self.phase = "take"

    def deadlock_report(self) -> str:
        return (f"stuck at step {self.step} ({self.phase}): counts {self.scheduler.counts()}, "
                f"capacity {self.scheduler.can_admit()}")

    def check_nothing_lost(self):
        left = self.scheduler.unconsumed_group_ids()
        assert sorted(self.trained + left) == sorted(self.prompt_of), "every admitted group is trained or still held"
        assert len(set(self.trained)) == len(self.trained)


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("partial", [False, True], ids=["drain", "partial"])
def test_random_schedules_never_exceed_the_bound_lose_or_duplicate_and_train_oldest_first(partial, max_staleness):
    histogram = {}
    for seed in range(200):  # x 8 cases: 1,600 schedules
        schedule = RandomSchedule(seed, max_staleness=max_staleness, groups_per_step=1 + seed % 4,
                                  partial=partial).run(steps=6)
        schedule.check_nothing_lost()
        for s, count in schedule.scheduler.staleness_histogram().items():
            histogram[s] = histogram.get(s, 0) + count
    assert max(histogram) == max_staleness  # reached (the schedules are not all on-policy), never passed


def test_random_schedules_with_k0_train_the_synchronous_batches_in_order():
    for seed in range(600):
        b = 1 + seed % 4
        schedule = RandomSchedule(seed, max_staleness=0, groups_per_step=b, partial=seed % 2 == 1).run(steps=5)
        sync = [list(range(step * b, (step + 1) * b)) for step in range(5)]
        assert schedule.batches == sync
        assert schedule.scheduler.staleness_histogram() == {0: 5 * b}
        assert schedule.scheduler.metrics()["async/off_policy_token_frac_total"] == 0.0


def test_admission_capacity_is_k_plus_one_batches_in_the_steady_state_and_k_while_a_step_trains():
    common = dict(max_staleness=2, groups_per_step=4)
    assert admission_capacity(policy_version=5, next_train_version=5, num_unconsumed=0, **common) == 12
    assert admission_capacity(policy_version=5, next_train_version=6, num_unconsumed=0, **common) == 8
    assert admission_capacity(policy_version=5, next_train_version=6, num_unconsumed=9, **common) == 0
    assert admission_capacity(policy_version=0, next_train_version=0, num_unconsumed=0,
                              max_staleness=0, groups_per_step=3) == 3


def scheduler(k=1, b=2, partial=False) -> AsyncRolloutScheduler:
    return AsyncRolloutScheduler(AsyncRolloutConfig(max_staleness=k, groups_per_step=b, partial_rollout=partial))


def test_a_slow_group_is_passed_over_until_it_is_due_then_the_trainer_waits_for_it():
    s = scheduler(k=1, b=1)
    slow, fast = s.admit("slow"), s.admit("fast")
    assert not s.can_admit()  # (K + 1) * B = 2 groups
    s.complete(fast, "r", [[0, 0]])
    batch = s.take_batch(0, timeout=0)
    assert [g.payload for g in batch.groups] == ["fast"]  # the slow one is not due yet
    s.publish_version(1)
    late = s.admit("late")
    s.complete(late, "r", [[1]])
    assert s.take_batch(1, timeout=0) is None  # "slow" (version 0) is due at step 1: it is waited for
    s.complete(slow, "r", [[0] * 50])
    batch = s.take_batch(1, timeout=0)
    assert [g.payload for g in batch.groups] == ["slow"] and batch.staleness == [1]
    assert s.counts() == {"running": 0, "interrupted": 0, "complete": 1}  # "late" stays buffered, not dropped


def test_interrupted_groups_are_continued_oldest_first_and_before_new_prompts():
    s = scheduler(k=1, b=2, partial=True)
    ids = [s.admit(p) for p in "abcd"]
    s.complete(ids[0], "r", [[0]])
    s.complete(ids[1], "r", [[0]])
    s.take_batch(0)
    s.begin_update()
    s.interrupt(ids[3], "partial d")
    s.interrupt(ids[2], "partial c")
    assert s.pop_continuation() is None and not s.can_admit()  # the update window is open
    s.publish_version(1)
    assert not s.can_admit()  # continuations first
    assert [s.pop_continuation().state for _ in range(2)] == ["partial c", "partial d"]
    assert s.can_admit()
    s.complete(ids[2], "r", [[0, 1]])  # the token after the interrupt came from version 1
    s.complete(ids[3], "r", [[1]])
    batch = s.take_batch(1)
    assert batch.staleness == [1, 0]
    assert batch.metrics()["async/off_policy_token_frac"] == pytest.approx(1 / 3)
    assert batch.metrics()["async/interrupted_groups"] == 2


def test_mistakes_are_refused_with_what_was_wrong():
    s = scheduler(k=0, b=1)
    with pytest.raises(ValueError, match="partial_rollout"):
        s.interrupt(s.admit("a"), None)
    assert not s.can_admit() and s.admit("b") is None  # K = 0: one batch, then nothing until version 1
    with pytest.raises(ValueError, match="next step to train is 0"):
        s.take_batch(1)
    with pytest.raises(ValueError, match="at most the next train version 0"):
        s.publish_version(1)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        AsyncRolloutConfig(max_staleness=-1, groups_per_step=1)
    s3 = AsyncRolloutScheduler(AsyncRolloutConfig(max_staleness=1, groups_per_step=1, start_version=3))
    group = s3.admit("x")
    with pytest.raises(ValueError, match="admitted at policy version 3 but has tokens of version 2"):
        s3.complete(group, "r", [[2, 3]])
    with pytest.raises(ValueError, match="not running"):
        s3.complete(99, "r", [])


def test_a_checkpoint_holds_admission_saves_the_settled_buffer_and_a_resumed_scheduler_trains_it_the_same():
    s = scheduler(k=1, b=1, partial=True)
    old, new = s.admit("old"), s.admit("new")
    s.complete(old, "r-old", [[0, 0]])
    s.take_batch(0)
    s.begin_update()
    s.interrupt(new, "partial")
    s.publish_version(1)
    s.hold_admission()
    assert s.pop_continuation().state == "partial"  # continuations still run while admission is held
    assert not s.can_admit() and not s.wait_until_settled(timeout=0)
    with pytest.raises(ValueError, match="running or interrupted"):
        s.state_dict()
    s.complete(new, "r-new", [[0, 1]])
    assert s.wait_until_settled(timeout=0)
    state = s.state_dict()
    s.release_admission()
    assert s.can_admit()
    resumed = AsyncRolloutScheduler(AsyncRolloutConfig(max_staleness=1, groups_per_step=1, partial_rollout=True,
                                                       start_version=1))
    assert resumed.load_state_dict(state) == [0]
    assert resumed.can_admit() and s.can_admit()  # one more: (a + K - t + 1) * B - U = 2 - 1, in both
    assert resumed.metrics() == s.metrics()  # the buffer and the run totals
    expected, again = s.take_batch(1, timeout=0), resumed.take_batch(1, timeout=0)
    assert (again.groups[0].payload, again.groups[0].result, again.staleness, again.metrics()["async/interrupted_groups"]) \
        == (expected.groups[0].payload, expected.groups[0].result, expected.staleness, 1.0) == ("new", "r-new", [1], 1.0)
    # A smaller K could not train the saved group (admitted at version 0) at step 1: refused, naming the flag.
    strict = AsyncRolloutScheduler(AsyncRolloutConfig(max_staleness=0, groups_per_step=1, start_version=1))
    with pytest.raises(ValueError, match="--max-staleness 0 .*resume with the --max-staleness"):
        strict.load_state_dict(state)


def test_close_wakes_a_waiting_trainer_and_producer():
    s = scheduler(k=0, b=1)
    s.admit("a")  # never completes
    results = {}
    threads = [threading.Thread(target=lambda: results.update(batch=s.take_batch(0))),
               threading.Thread(target=lambda: results.update(work=s.wait_for_work())),
               threading.Thread(target=lambda: results.update(drained=s.wait_until_drained()))]
    for thread in threads:
        thread.start()
    s.close()
    for thread in threads:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in threads)
    assert results == {"batch": None, "work": False, "drained": False}
    assert s.unconsumed_group_ids() == [0]  # closing does not discard


def test_threads_producer_engine_and_trainer_keep_the_bound():
    """The same roles on real threads (no sleeps): the producer admits as fast as it may, an engine
    thread finishes groups in random order, the trainer takes, publishes, and ends with close()."""
    rng = random.Random(0)
    s = AsyncRolloutScheduler(AsyncRolloutConfig(max_staleness=1, groups_per_step=3, partial_rollout=True))
    running, lock, version = {}, threading.Lock(), [0]

    def producer():
        while s.wait_for_work():
            continuation = s.pop_continuation()
            if continuation is not None:
                with lock:
                    running[continuation.group_id] = continuation.state
            else:
                with lock:
                    group = s.admit("p")
                    if group is not None:
                        running[group] = [version[0]]

    def engine():
        while not s.closed:
            with lock:
                group = rng.choice(sorted(running)) if running else None
                tokens = running.pop(group) if running else None
            if group is None:
                time.sleep(0.0001)
            else:
                s.complete(group, None, [tokens + [version[0]]])

    workers = [threading.Thread(target=producer), threading.Thread(target=engine)]
    for worker in workers:
        worker.start()
    for step in range(30):
        batch = s.take_batch(step, timeout=10)
        assert batch is not None and max(batch.staleness) <= 1
        s.begin_update()
        with lock:
            for group in list(running)[:1]:
                s.interrupt(group, running.pop(group))
            version[0] = step + 1
        s.publish_version(step + 1)
    s.close()
    for worker in workers:
        worker.join(timeout=5)
    assert not any(worker.is_alive() for worker in workers)
    assert sum(s.staleness_histogram().values()) == 90
