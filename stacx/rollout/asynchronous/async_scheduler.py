"""Admission and batching for asynchronous rollout with a bounded policy lag.

The driver's producer thread (which feeds prompt groups to the engine) and the trainer (which
takes a batch per optimizer step) share one `AsyncRolloutScheduler`. It is pure bookkeeping:
standard library only, thread-safe behind one condition variable, no engine and no process group.

Words
-----
- **Policy version.** The number of optimizer steps behind a set of policy weights: the run starts
  at `start_version` (0, or the resumed step), and training step t reads the weights of version t
  and produces version t + 1. The *published* version `a` is the newest one the engine has
  confirmed it serves (`publish_version`); the engine never serves anything older than `a`.
- **Train version.** Step t trains at version t (`take_batch(t)`); steps are taken in order.
- **A token's version.** The version of the weights that sampled it (the engine records it per
  token; with partial rollout one response holds several versions).
- **Staleness** of a group trained at version t: `t - v_min`, with `v_min` the oldest version of
  any of its tokens (its admission version if it has none). K = `max_staleness` bounds it.
  Staleness 0 is on-policy; a token is *off-policy* when its version is below the train version.
- **Unconsumed groups** U: admitted and not yet taken for training, whether running on the
  engine, interrupted (partial rollout) or complete and buffered. B = `groups_per_step`.

Admission (`admission_capacity`): with published version a and next train version t, a new group
is admitted while `U + 1 <= (a + K - t + 1) * B`. In the steady state a = t, so that is
"in flight plus buffered stays within (K + 1) batches"; while step t trains (its batch taken, its
weights not yet published) it is K batches. A group is never discarded: it leaves the scheduler
only in a training batch.

Batching (`take_batch(t)`): the batch is the B oldest *complete* groups (admission order, which
is oldest-version order) provided that every group left behind can still be trained within its
bound; otherwise the trainer waits for more completions. The batch lists its groups oldest first.

Why no group is trained beyond its bound. Give each group the deadline `d = a_g + K` (a_g: its
admission version). The scheduler keeps the invariant

    F(t): for every d >= t, #{unconsumed groups with deadline <= d} <= (d - t + 1) * B
          (in particular no unconsumed group has a deadline before t).

- Admission at version a: a is >= every earlier admission version, so the new deadline a + K is
  the largest; only the counts for d >= a + K grow (by one) and the tightest of those, d = a + K,
  is exactly the admission test above. Publishing a version or interrupting / continuing a
  group changes no deadline.
- A take at step t removes B groups and must leave F(t + 1). The scheduler checks exactly that.
  The check passes once the B oldest unconsumed groups are complete: removing the B earliest
  deadlines from a set satisfying F(t) leaves max(0, count - B) <= (d - t) * B for every d. So
  the trainer never waits forever while the engine finishes its work, and it never waits when
  some valid batch exists: for every d, the B oldest complete groups contain at least as many
  groups with deadline <= d as any other B complete groups.
- A group taken at step t therefore has t <= a_g + K, and a_g <= v_min (the engine serves
  nothing older than the published version; `complete` refuses a token older than a_g), so its
  staleness t - v_min <= t - a_g <= K.

K = 0 is the synchronous schedule: after version t is published, exactly B groups can be
admitted (the next B prompts), and F(t) forces all of them into batch t, in admission order;
nothing more is admitted until version t + 1 is published.

Partial rollout: `begin_update()` closes admission and continuation (the update window); the
driver interrupts the engine's in-flight groups and hands each one's state to `interrupt`; after
`publish_version`, `pop_continuation` returns them, oldest first, ahead of any new admission. An
interrupted group keeps its deadline, so continuing it needs no capacity.

Engines behind: a group whose engine call found the only engines restarted and waiting for the current
weights is `set_aside` (an update window is opened first); it waits like an interrupted group (its deadline
kept, so the bound's proof is unchanged) and is continued after `publish_version`, or after `end_update` when
the trainer pushed the published version again to bring the restarted engines up to date.

Checkpoints: `hold_admission()` stops admission (continuations still run), `wait_until_settled()`
waits until every unconsumed group is complete, and `state_dict()` then lists them with their
admission versions (plus the run totals); `release_admission()` reopens. A fresh scheduler of the
resumed run (start_version = the saved step t) takes them back with `load_state_dict` before anything
is admitted: they keep their deadlines, and F(t) is checked for them, so the resumed run trains the
batches the uninterrupted run would have trained.
"""

from __future__ import annotations

import bisect
import collections
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence


def check_restorable(admit_versions: list[int], *, train_version: int, max_staleness: int, groups_per_step: int
                     ) -> None:
    """ValueError naming the flags when saved untrained groups (their admission versions, oldest first)
    cannot all be trained in order from `train_version` under K = max_staleness and B = groups_per_step:
    the i-th oldest (1-based) needs i <= (admit_version + K - t + 1) * B, the invariant `take_batch` keeps."""
    t, k, batch_size = train_version, max_staleness, groups_per_step
    for position, admitted in enumerate(admit_versions, start=1):
        if position > (int(admitted) + k - t + 1) * batch_size:
            raise ValueError(
                f"the checkpoint holds {len(admit_versions)} generated, untrained groups (admitted at versions "
                f"{list(admit_versions)}) that this run cannot train by step {t} + K with --max-staleness {k} and "
                f"{batch_size} groups per step; resume with the --max-staleness and --rollout-batch-size the "
                "checkpoint was written with")


def admission_capacity(*, policy_version: int, next_train_version: int, max_staleness: int,
                       groups_per_step: int, num_unconsumed: int) -> int:
    """How many more groups may be admitted now: `(a + K - t + 1) * B - U`, at least 0.

    a = `policy_version` (published), t = `next_train_version`, K = `max_staleness`,
    B = `groups_per_step`, U = `num_unconsumed` (running + interrupted + buffered).
    """
    return max(0, (policy_version + max_staleness - next_train_version + 1) * groups_per_step - num_unconsumed)


@dataclass(frozen=True, kw_only=True)
class AsyncRolloutConfig:
    """Settings of one scheduler."""

    max_staleness: int
    """K: a group whose oldest token came from version v is trained at version v + K at the latest; 0 is synchronous."""
    groups_per_step: int
    """B: prompt groups in each training step's batch."""
    samples_per_group: int = 1
    """Responses per prompt (GRPO's n); used for sample counts only."""
    partial_rollout: bool = False
    """Groups interrupted at a weight update are kept and continued under the new weights; off, `interrupt` is refused."""
    start_version: int = 0
    """Version of the weights the run starts from (the step a resumed run starts at)."""

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 is the synchronous schedule), got {self.max_staleness}")
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.samples_per_group < 1:
            raise ValueError(f"samples_per_group must be >= 1, got {self.samples_per_group}")
        if self.start_version < 0:
            raise ValueError(f"start_version must be >= 0, got {self.start_version}")


class GroupState(enum.Enum):
    RUNNING = "running"
    """Admitted (or continued) and on the engine."""
    INTERRUPTED = "interrupted"
    """Stopped at a weight update, waiting to be continued."""
    COMPLETE = "complete"
    """Finished, buffered until a batch takes it."""


@dataclass(frozen=True)
class Continuation:
    """An interrupted group to resubmit under the new weights: `state` is what `interrupt` was given."""

    group_id: int
    payload: Any
    state: Any
    admit_version: int


@dataclass(frozen=True)
class CompletedGroup:
    """One group of a training batch."""

    group_id: int
    payload: Any
    """What `admit` was given (the prompt)."""
    result: Any
    """What `complete` was given (the responses)."""
    admit_version: int
    oldest_version: int
    """The oldest version of any of its tokens (the admission version when it has none)."""
    version_tokens: dict[int, int]
    """Version -> number of its tokens that version sampled."""
    num_interrupts: int

    @property
    def num_tokens(self) -> int:
        return sum(self.version_tokens.values())


@dataclass(frozen=True)
class TrainBatch:
    """The groups of training step `train_version`, oldest first."""

    train_version: int
    groups: list[CompletedGroup]
    wait_s: float
    """How long `take_batch` waited for it."""

    @property
    def staleness(self) -> list[int]:
        return [self.train_version - g.oldest_version for g in self.groups]

    @property
    def num_off_policy_tokens(self) -> int:
        return sum(n for g in self.groups for v, n in g.version_tokens.items() if v < self.train_version)

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.groups)

    def metrics(self) -> dict[str, float]:
        """`async/staleness_max`, `_mean`, `async/off_policy_token_frac`, `async/staleness_<s>_groups`, ..."""
        staleness = self.staleness
        out = {
            "async/staleness_max": float(max(staleness)),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/off_policy_token_frac": self.num_off_policy_tokens / max(1, self.num_tokens),
            "async/interrupted_groups": float(sum(1 for g in self.groups if g.num_interrupts)),
            "async/batch_wait_s": self.wait_s,
        }
        for s, count in sorted(collections.Counter(staleness).items()):
            out[f"async/staleness_{s}_groups"] = float(count)
        return out


@dataclass
class _Group:
    group_id: int
    payload: Any
    admit_version: int
    state: GroupState = GroupState.RUNNING
    result: Any = None
    partial: Any = None
    version_tokens: dict[int, int] = field(default_factory=dict)
    num_interrupts: int = 0


class AsyncRolloutScheduler:
    """Admission control, completion buffer and oldest-first batching under a staleness bound K.

    Producer: `wait_for_work` -> `pop_continuation` (partial rollout) or `admit` ->
    engine -> `complete` (or `interrupt` at an update). Trainer: `take_batch(t)` -> train ->
    `begin_update` -> (interrupt or `wait_until_drained`) -> push weights -> `publish_version(t + 1)`.
    `close()` wakes every waiter (they return None / False). See the module docstring for the
    definitions and the bound's proof.
    """

    def __init__(self, config: AsyncRolloutConfig):
        self.config = config
        self._cond = threading.Condition()
        self._groups: dict[int, _Group] = {}  # unconsumed, in admission order (= oldest first)
        self._continuations: list[int] = []  # interrupted group ids, sorted (oldest first)
        self._policy_version = config.start_version
        self._next_train_version = config.start_version
        self._next_group_id = 0
        self._updating = False
        self._holding = False
        self._closed = False
        self._staleness_histogram: collections.Counter[int] = collections.Counter()
        self._tokens = 0
        self._off_policy_tokens = 0
        self._num_interrupts = 0
        self._num_trained_groups = 0

    # ---- state ---------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def next_train_version(self) -> int:
        return self._next_train_version

    @property
    def closed(self) -> bool:
        return self._closed

    def counts(self) -> dict[str, int]:
        """Unconsumed groups by state: running, interrupted, complete (buffered)."""
        with self._cond:
            out = {state.value: 0 for state in GroupState}
            for group in self._groups.values():
                out[group.state.value] += 1
            return out

    def unconsumed_group_ids(self) -> list[int]:
        """Admitted and not yet trained, oldest first."""
        with self._cond:
            return list(self._groups)

    def _capacity(self) -> int:
        return admission_capacity(policy_version=self._policy_version, next_train_version=self._next_train_version,
                                  max_staleness=self.config.max_staleness, groups_per_step=self.config.groups_per_step,
                                  num_unconsumed=len(self._groups))

    # ---- producer ------------------------------------------------------------------------------

    def can_admit(self) -> bool:
        """A new group may be admitted now: not closed, no update window, no continuation waiting, capacity left."""
        with self._cond:
            return self._can_admit()

    def _can_admit(self) -> bool:
        return not (self._closed or self._updating or self._holding or self._continuations) and self._capacity() > 0

    def admit(self, payload: Any) -> Optional[int]:
        """Record a new group at the published version and return its id; None when `can_admit()` is
        False now (an update window may open between the two calls: keep the payload, admit it next)."""
        with self._cond:
            if not self._can_admit():
                return None
            group_id = self._next_group_id
            self._next_group_id += 1
            self._groups[group_id] = _Group(group_id, payload, self._policy_version)
            return group_id

    def pop_continuation(self) -> Optional[Continuation]:
        """The oldest interrupted group, now running again; None if none waits or an update window is open."""
        with self._cond:
            if self._closed or self._updating or not self._continuations:
                return None
            group = self._groups[self._continuations.pop(0)]
            group.state = GroupState.RUNNING
            state, group.partial = group.partial, None
            return Continuation(group.group_id, group.payload, state, group.admit_version)

    def wait_for_work(self, timeout: Optional[float] = None) -> bool:
        """Block until a continuation waits or a group can be admitted: True; False when closed or timed out."""
        with self._cond:
            self._cond.wait_for(self._has_work_or_closed, timeout)
            return not self._closed and self._has_work_or_closed()

    def _has_work_or_closed(self) -> bool:
        return self._closed or (not self._updating and bool(self._continuations)) or self._can_admit()

    def complete(self, group_id: int, result: Any, token_versions: Iterable[Sequence[int]]) -> None:
        """A running group finished. `token_versions`: per response, the version of each of its tokens.

        A token older than the group's admission version means the engine served weights older
        than the published version: refused (the bound would not hold).
        """
        counts: collections.Counter[int] = collections.Counter()
        for versions in token_versions:
            counts.update(versions)
        with self._cond:
            group = self._running(group_id, "complete")
            if counts and min(counts) < group.admit_version:
                raise ValueError(
                    f"group {group_id} was admitted at policy version {group.admit_version} but has tokens of "
                    f"version {min(counts)}: the engine must never serve weights older than the published version")
            for version, n in counts.items():
                group.version_tokens[version] = group.version_tokens.get(version, 0) + n
            group.state, group.result = GroupState.COMPLETE, result
            self._cond.notify_all()

    def interrupt(self, group_id: int, state: Any) -> None:
        """A running group was stopped at a weight update; `state` (its partial responses) is kept for its continuation."""
        with self._cond:
            if not self.config.partial_rollout:
                raise ValueError("interrupt needs partial_rollout=True; without it, updates wait for in-flight "
                                 "groups to finish (wait_until_drained)")
            group = self._running(group_id, "interrupt")
            group.state, group.partial = GroupState.INTERRUPTED, state
            group.num_interrupts += 1
            self._num_interrupts += 1
            bisect.insort(self._continuations, group_id)  # admission order: the oldest is continued first
            self._cond.notify_all()

    def set_aside(self, group_id: int, state: Any) -> None:
        """A running group whose engine call found the engines behind the pool's weights (restarted ones wait for
        the current weights: stacx.rollout.engine_health.EnginesBehind) waits like an interrupted group, with or
        without partial rollout: it keeps its deadline and is continued first once the window closes
        (`publish_version`, or `end_update` after a push of the published version). Open the update window first
        (`begin_update`), so that it is not continued before the engines are refreshed."""
        with self._cond:
            group = self._running(group_id, "set_aside")
            group.state, group.partial = GroupState.INTERRUPTED, state
            bisect.insort(self._continuations, group_id)
            self._cond.notify_all()

    def _running(self, group_id: int, action: str) -> _Group:
        group = self._groups.get(group_id)
        if group is None or group.state is not GroupState.RUNNING:
            state = "unknown or already trained" if group is None else group.state.value
            raise ValueError(f"{action}({group_id}): the group is {state}, not running")
        return group

    # ---- trainer -------------------------------------------------------------------------------

    def take_batch(self, train_version: int, timeout: Optional[float] = None) -> Optional[TrainBatch]:
        """The batch of step `train_version` (which must be `next_train_version`): the B oldest complete
        groups, once every group left behind can still be trained within K. Blocks until then;
        None when closed or after `timeout` seconds (0: try once)."""
        start = time.monotonic()
        with self._cond:
            if train_version != self._next_train_version:
                raise ValueError(f"take_batch({train_version}): the next step to train is {self._next_train_version}")
            while True:
                if self._closed:
                    return None
                chosen = self._choose(train_version)
                if chosen is not None:
                    break
                left = None if timeout is None else start + timeout - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            groups = [self._consume(self._groups.pop(group_id), train_version) for group_id in chosen]
            self._next_train_version += 1
            self._cond.notify_all()
        return TrainBatch(train_version, groups, time.monotonic() - start)

    def _choose(self, t: int) -> Optional[list[int]]:
        """Ids of the B oldest complete groups if taking them leaves F(t + 1), else None."""
        batch_size, k = self.config.groups_per_step, self.config.max_staleness
        chosen, remaining = [], 0
        for group_id, group in self._groups.items():
            if len(chosen) < batch_size and group.state is GroupState.COMPLETE:
                chosen.append(group_id)
                continue
            remaining += 1  # groups are in deadline order: `remaining` counts those with deadline <= this one's
            if remaining > (group.admit_version + k - t) * batch_size:
                return None
        return chosen if len(chosen) == batch_size else None

    def _consume(self, group: _Group, t: int) -> CompletedGroup:
        oldest = min(group.version_tokens, default=group.admit_version)
        assert t - oldest <= self.config.max_staleness, (group.group_id, t, oldest)
        self._staleness_histogram[t - oldest] += 1
        self._tokens += sum(group.version_tokens.values())
        self._off_policy_tokens += sum(n for v, n in group.version_tokens.items() if v < t)
        self._num_trained_groups += 1
        return CompletedGroup(group_id=group.group_id, payload=group.payload, result=group.result,
                              admit_version=group.admit_version, oldest_version=oldest,
                              version_tokens=dict(group.version_tokens), num_interrupts=group.num_interrupts)

    def begin_update(self) -> None:
        """Open the update window: no admission and no continuation until `publish_version`."""
        with self._cond:
            self._updating = True

    def wait_until_drained(self, timeout: Optional[float] = None) -> bool:
        """Block until no group runs on the engine (an update without partial rollout): True; False if
        closed or timed out."""
        with self._cond:
            self._cond.wait_for(self._drained_or_closed, timeout)
            return not self._closed and self._drained_or_closed()

    def _drained_or_closed(self) -> bool:
        return self._closed or all(g.state is not GroupState.RUNNING for g in self._groups.values())

    def publish_version(self, version: int) -> None:
        """The engine now serves `version` (> the published one, <= next_train_version); closes the update window."""
        with self._cond:
            if not self._policy_version < version <= self._next_train_version:
                raise ValueError(f"publish_version({version}): must be newer than the published version "
                                 f"{self._policy_version} and at most the next train version {self._next_train_version} "
                                 f"(version v exists once step v - 1 was taken)")
            self._policy_version = version
            self._updating = False
            self._cond.notify_all()

    def end_update(self) -> None:
        """Close the update window without a new version: the engines were refreshed with the published version's
        weights (restarted engines brought up to date); set-aside groups are continued first, admission reopens."""
        with self._cond:
            self._updating = False
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; afterwards waits return None / False and admission is refused. Unconsumed
        groups stay listed (`unconsumed_group_ids`): closing discards nothing."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- checkpoints -----------------------------------------------------------------------------

    def hold_admission(self) -> None:
        """Admit no new group until `release_admission` (a checkpoint is written); continuations still run."""
        with self._cond:
            self._holding = True

    def release_admission(self) -> None:
        with self._cond:
            self._holding = False
            self._cond.notify_all()

    def wait_until_settled(self, timeout: Optional[float] = None) -> bool:
        """Block until every unconsumed group is complete (none running or interrupted): True; False if
        closed or timed out. With admission held, the buffer then stays as it is until the trainer acts."""
        with self._cond:
            self._cond.wait_for(self._settled_or_closed, timeout)
            return not self._closed and self._settled_or_closed()

    def _settled_or_closed(self) -> bool:
        return self._closed or all(g.state is GroupState.COMPLETE for g in self._groups.values())

    def state_dict(self) -> dict[str, Any]:
        """The buffered groups (oldest first: payload, result, admission version, version -> tokens,
        interrupts) and the run totals; only when settled (`wait_until_settled`), so nothing is lost."""
        with self._cond:
            unsettled = [g.group_id for g in self._groups.values() if g.state is not GroupState.COMPLETE]
            if unsettled:
                raise ValueError(f"state_dict: groups {unsettled} are running or interrupted; hold admission and "
                                 "wait_until_settled first")
            return {
                "groups": [{"payload": g.payload, "result": g.result, "admit_version": g.admit_version,
                            "version_tokens": dict(g.version_tokens), "num_interrupts": g.num_interrupts}
                           for g in self._groups.values()],
                "staleness_histogram": dict(self._staleness_histogram), "tokens": self._tokens,
                "off_policy_tokens": self._off_policy_tokens, "num_interrupts": self._num_interrupts,
                "num_trained_groups": self._num_trained_groups,
            }

    def load_state_dict(self, state: dict[str, Any]) -> list[int]:
        """Restore a `state_dict` into a fresh scheduler (nothing admitted yet; its start_version is the
        step the checkpoint was written after). Returns the restored groups' ids, oldest first.

        The groups must still be trainable in order under this run's K and B: the i-th oldest (1-based)
        needs i <= (admit_version + K - t + 1) * B, the invariant `take_batch` keeps (module docstring);
        otherwise ValueError naming the flags."""
        with self._cond:
            if self._groups or self._next_group_id:
                raise ValueError("load_state_dict: the scheduler has admitted groups already; restore before start")
            groups = list(state.get("groups", ()))
            check_restorable([g["admit_version"] for g in groups], train_version=self._next_train_version,
                             max_staleness=self.config.max_staleness, groups_per_step=self.config.groups_per_step)
            ids = []
            for saved in groups:
                group = _Group(self._next_group_id, saved["payload"], int(saved["admit_version"]),
                               state=GroupState.COMPLETE, result=saved["result"],
                               version_tokens={int(v): int(n) for v, n in saved["version_tokens"].items()},
                               num_interrupts=int(saved["num_interrupts"]))
                self._groups[group.group_id] = group
                ids.append(group.group_id)
                self._next_group_id += 1
            self._staleness_histogram = collections.Counter(
                {int(s): int(n) for s, n in state.get("staleness_histogram", {}).items()})
            self._tokens = int(state.get("tokens", 0))
            self._off_policy_tokens = int(state.get("off_policy_tokens", 0))
            self._num_interrupts = int(state.get("num_interrupts", 0))
            self._num_trained_groups = int(state.get("num_trained_groups", 0))
            self._cond.notify_all()
            return ids

    # ---- metrics -------------------------------------------------------------------------------

    def staleness_histogram(self) -> dict[int, int]:
        """Staleness -> number of trained groups, over the run so far."""
        with self._cond:
            return dict(sorted(self._staleness_histogram.items()))

    def metrics(self) -> dict[str, float]:
        """Run-so-far numbers: off-policy token fraction, interrupts, and the current queue."""
        with self._cond:
            counts = collections.Counter(g.state for g in self._groups.values())
            return {
                "async/trained_groups": float(self._num_trained_groups),
                "async/trained_samples": float(self._num_trained_groups * self.config.samples_per_group),
                "async/off_policy_token_frac_total": self._off_policy_tokens / max(1, self._tokens),
                "async/interrupts_total": float(self._num_interrupts),
                "async/running_groups": float(counts[GroupState.RUNNING]),
                "async/interrupted_groups_waiting": float(counts[GroupState.INTERRUPTED]),
                "async/buffered_groups": float(counts[GroupState.COMPLETE]),
                "async/policy_version": float(self._policy_version),
            }
