"""Engine failures: a dead or hung rollout engine is noticed, restarted or set aside, and its requests re-issued.

    supervisor = EngineSupervisor(engines, names=urls, settings=rollout_section,  # the run's RolloutSection
                                  restart=restart_server)          # None for attached servers (--rollout-urls)
    pool = EnginePool(engines, names=urls, supervisor=supervisor)  # dispatches to live engines only

An engine has failed when (`EngineSupervisor.call`):
- a call to it fails at the transport (`ServerUnavailableError`: refused or reset connections, timeouts and
  5xx answers once the client's own retries are spent; a 4xx is the caller's mistake and is raised as is);
- it misses `HEALTH_MISSES` health checks in a row while one of its generations is in flight (`/health`
  is probed every `--engine-health-interval-s`);
- a generation on it runs past `--engine-deadline-s`.

The settings are the run's (`RolloutSection`: min_live_engines, engine_deadline_s, engine_health_interval_s,
attached_engine_wait_s, checked when the section is made).

What follows:
- a **launched** engine (the run started its server; `restart` given) is set aside, its client closed (a
  request still retrying against it stops), and its server stopped and started again on the same URL
  in a background thread (`rollout/engine_restarts`). It serves again only at the pool's weight version:
  at once when that is the version a fresh server loads (0: no weights pushed yet), else from the next
  weight push, which goes to it like to every engine and is version-checked;
- an **attached** engine (`--rollout-urls`, or a kind whose servers cannot be restarted; `attached`: those a 'cpu'
  run attached beside the ones it launched) is set aside (`rollout/engines_set_aside`; its
  client closed and, with `connect`, a fresh one made for it) and probed at most once per health interval;
  when its health check passes it rejoins (`rollout/engines_rejoined`), by the same version rule (a server
  restarted by its owner serves its start weights: behind, the next push brings it). Below min_live_engines
  it is waited for, up to `--attached-engine-wait-s` after it failed, probed every health interval (the wait
  logged at its start and end, `rollout/attached_engine_waits`, `rollout/attached_engine_wait_s`);
- the failed call's requests go to a live engine (`rollout/requests_reissued`). A request that continues
  an aborted generation (partial rollout) carries its tokens so far in its prompt, so it continues from
  them; requests with rids on a stalled engine (missed health checks, the deadline) are aborted there first
  and continue from the tokens it returns (stacx.rollout.salvage); a dead engine's tokens are lost, unless
  the transport error carries them (`partial`: the outputs a streaming client received before the
  connection broke, unfinished ones with finish reason "abort"), which continue the same way;
- below min_live_engines the restarts under way are waited for; engines back but behind the pool's weights
  raise `EnginesBehind` (the trainer pushes the weights and the step rolls out again);
- with fewer than `min_live_engines` engines live, `EnginesLost` stops the run naming each engine out and why.

The pool never dispatches to an engine that is restarting, set aside or behind the pool's version, so
engines never serve different weight versions unnoticed; the per-token versions of every output say
which weights produced each token.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, List, Optional, Sequence

from stacx.rollout.sections import RolloutSection
from stacx.wire.http_client import ServerUnavailableError

logger = logging.getLogger(__name__)

LIVE, RESTARTING, BEHIND, OUT = "live", "restarting", "behind", "out"
"""Engine states: serving; its server restarting; serving an older weight version than the pool (waits
for the next push); set aside (failed, not restartable, or its restart failed)."""


HEALTH_MISSES = 2
"""Health checks an engine misses in a row, while one of its generations is in flight, that mark it dead."""


class EngineFailed(RuntimeError):
    """Engine `index` failed during a call (the supervisor has set it aside); re-issue the call elsewhere."""

    def __init__(self, index: int, name: str, reason: str):
        self.index, self.name, self.reason = index, name, reason
        self.partial: Optional[Any] = None
        """What the call returned after the engine was asked to abort it (stacx.rollout.salvage), else None."""
        super().__init__(f"rollout engine {name} failed: {reason}")


class EnginesLost(RuntimeError):
    """Fewer than --min-live-engines engines are live: the run stops, naming each engine out and why."""


class EnginesBehind(EnginesLost):
    """Too few engines are live, but enough serve again behind the pool's weight version (restarted, or back
    after a failure): the trainer pushes the weights of `version` to them (`StacxTrainer.shared_batch`) and
    the step's rollout starts again. Left uncaught it stops the run like `EnginesLost`."""

    def __init__(self, message: str, *, version: int):
        super().__init__(message)
        self.version = version


CALL_THREADS_PER_ENGINE = 64
"""Watched calls in flight at once per engine (threads start as needed): as many as an asynchronous rollout's
concurrent group calls, which a server merges into its batches; fewer would throttle it."""

SALVAGE_WAIT_S = 5.0
"""At least this long a stalled engine is given to answer the abort of a call, and the call to return after it."""

Restart = Callable[[int], Any]
"""restart(index) -> the new client of engine `index`, once its server serves again (blocking)."""


class EngineSupervisor:
    """The state of each engine of a pool, its failures, restarts and the counters (module doc)."""

    def __init__(self, engines: List[Any], *, names: Sequence[str], settings: RolloutSection = RolloutSection(),
                 restart: Optional[Restart] = None, clock: Callable[[], float] = time.monotonic,
                 connect: Optional[Callable[[int], Any]] = None, attached: Sequence[int] = ()):
        """engines: the pool's clients (this list is updated in place when a restarted engine gets a new client);
        settings: the run's rollout section, whose engine fault fields the supervisor reads (min_live_engines,
        engine_deadline_s, engine_health_interval_s, attached_engine_wait_s); restart: None when the servers cannot
        be restarted (they are attached); connect(index): a fresh client of engine `index` (a failed attached
        engine's client is closed, so that a request still retrying on it stops; its probes and its rejoining use
        the new one). None: the closed client is probed (it must answer again). attached: the engines the run
        attached beside the ones `restart` restarts (a 'cpu' run given --rollout-urls); with `restart` None every
        engine is attached."""
        self.engines = engines
        self.names = list(names)
        self.settings = settings
        self.restart = restart
        self.attached = frozenset(range(len(engines)) if restart is None else attached)
        """The engines the run cannot restart (set aside when they fail, back when their health check passes)."""
        self.connect = connect
        self.clock = clock
        self.states = [LIVE] * len(engines)
        self.reasons: list[str] = [""] * len(engines)
        self.version = 0
        """The weight version the pool serves (the last one every live engine confirmed)."""
        self.updating = False
        """A weight update is under way (between pause and the version check): a restarted engine waits for it."""
        self.engine_restarts = 0
        self.engines_set_aside = 0
        """Failures of attached engines (each set aside until its health check passes)."""
        self.engines_rejoined = 0
        """Set-aside attached engines that passed their health check again and rejoined the pool."""
        self.generation = [0] * len(engines)
        """Failures of each engine so far: an engine whose count changed during a weight update missed its push."""
        self._update_generation = list(self.generation)
        self._pushed: Optional[set] = None
        """The engines the current weight push goes to (None before the first push)."""
        self.attached_engine_waits = 0
        """Times the rollout blocked below min_live_engines waiting for set-aside attached engines."""
        self.attached_engine_wait_s = 0.0
        """Seconds the rollout spent in those waits (counted once however many calls waited together)."""
        self._waiters = 0
        self._wait_started = 0.0
        self.requests_reissued = 0
        self.tokens_salvaged = 0
        """Tokens of failed engines' calls kept and continued on a live engine (stacx.rollout.salvage)."""
        self.failures: list[tuple[str, str]] = []
        """(engine, reason) of every failure noticed, in order."""
        self.health_check_s = 0.0
        """Seconds spent in health checks (the cost docs/performance.md reports)."""
        self._next_probe = [0.0] * len(engines)
        self._out_since = [0.0] * len(engines)
        """When each attached engine was set aside (its wait is bounded by attached_engine_wait_s from then)."""
        self._restarts: dict[int, threading.Thread] = {}
        self._lock = threading.RLock()
        self._calls = ThreadPoolExecutor(max_workers=CALL_THREADS_PER_ENGINE * len(engines),
                                         thread_name_prefix="engine-call")

    # ---- which engines serve -----------------------------------------------------------------

    def live(self) -> list[int]:
        """The live engines (set-aside attached engines probed first when due). Below min_live_engines the
        restarts under way are waited for; then `EnginesBehind` when enough engines serve again but behind the
        pool's weights (a single engine restarted after a push), else `EnginesLost`."""
        self._probe_set_aside()
        with self._lock:  # one view of the states and the restarts (a failing call sets both under the lock)
            live = self._in_state(LIVE)
            restarting = bool(self._restarts)
        if len(live) < self.settings.min_live_engines and restarting:
            self.wait_for_restarts()
            live = self._in_state(LIVE)
        if len(live) < self.settings.min_live_engines:
            live = self._wait_for_attached()
        if len(live) >= self.settings.min_live_engines:
            return live
        with self._lock:
            message = self._lost_message(len(live))
            if len(live) + len(self._in_state(BEHIND)) >= self.settings.min_live_engines:
                raise EnginesBehind(message + "; they serve again once the current weights are pushed to them",
                                    version=self.version)
            raise EnginesLost(message)

    def serving(self) -> bool:
        """Enough engines are live now to dispatch (without waiting for a restart)."""
        return len(self._in_state(LIVE)) >= self.settings.min_live_engines

    def _in_state(self, state: str) -> list[int]:
        with self._lock:
            return [i for i, current in enumerate(self.states) if current == state]

    def _wait_for_attached(self) -> list[int]:
        """Below min_live_engines: probe the set-aside attached engines still within attached_engine_wait_s of their
        failure, every health interval, until enough serve again (live, or behind the pool's weights) or none
        is left to wait for; returns the live engines. The wait is counted once however many calls wait in it
        (`attached_engine_waits`, `attached_engine_wait_s`)."""
        waited = False
        try:
            while True:
                live = self._in_state(LIVE)
                if len(live) + len(self._in_state(BEHIND)) >= self.settings.min_live_engines:
                    return live
                waiting = self._attached_waiting()
                if not waiting:
                    return live
                if not waited:
                    waited = True
                    self._begin_attached_wait(waiting, len(live))
                due = min(self._next_probe[i] for i in waiting)
                time.sleep(max(0.0, min(due - self.clock(), self.settings.engine_health_interval_s)))
                self._probe_set_aside()
        finally:
            if waited:
                self._end_attached_wait()

    def _begin_attached_wait(self, waiting: Sequence[int], num_live: int) -> None:
        with self._lock:
            self._waiters += 1
            if self._waiters > 1:
                return
            self.attached_engine_waits += 1
            self._wait_started = self.clock()
        logger.warning("only %d of %d rollout engines are live, fewer than --min-live-engines %d: the rollout waits "
                       "up to %g s (--attached-engine-wait-s) for the attached engine(s) %s to pass their health "
                       "check again", num_live, len(self.states), self.settings.min_live_engines,
                       self.settings.attached_engine_wait_s, ", ".join(self.names[i] for i in waiting))

    def _end_attached_wait(self) -> None:
        with self._lock:
            self._waiters -= 1
            if self._waiters == 0:
                seconds = self.clock() - self._wait_started
                self.attached_engine_wait_s += seconds
                logger.warning("the rollout waited %.1f s for set-aside attached engines (--attached-engine-wait-s)",
                               seconds)

    def _attached_waiting(self) -> list[int]:
        """The set-aside attached engines whose wait (attached_engine_wait_s from their failure) has not passed."""
        now = self.clock()
        with self._lock:
            return [i for i, state in enumerate(self.states) if state == OUT and i in self.attached
                    and now - self._out_since[i] < self.settings.attached_engine_wait_s]

    def _lost_message(self, num_live: int) -> str:
        out = [f"{self.names[i]} ({self.states[i]}: {self.reasons[i] or 'behind the pool weight version'})"
               for i, state in enumerate(self.states) if state != LIVE]
        attached = [self.names[i] for i, state in enumerate(self.states) if state == OUT and i in self.attached]
        waited = (f". The run cannot restart an attached server: {', '.join(attached)} did not pass its health check "
                  f"within --attached-engine-wait-s {self.settings.attached_engine_wait_s:g} s of failing; restart it, "
                  "or raise --attached-engine-wait-s to wait longer" if attached else "")
        return (f"only {num_live} of {len(self.states)} rollout engines are live, fewer than --min-live-engines "
                f"{self.settings.min_live_engines}: " + "; ".join(out) + waited + ". Check those servers (their logs "
                "say why they stopped), or lower --min-live-engines to go on with fewer")

    def _probe_set_aside(self) -> None:
        now = self.clock()
        for index in [i for i, state in enumerate(self.states) if state == OUT and i in self.attached]:
            if now < self._next_probe[index]:
                continue
            self._next_probe[index] = now + self.settings.engine_health_interval_s
            if self._healthy(index) and self._rejoin(index, why="its health check passes again"):
                with self._lock:
                    self.engines_rejoined += 1

    def _healthy(self, index: int) -> bool:
        started = self.clock()
        try:
            return bool(self.engines[index].health())
        except Exception:  # noqa: BLE001 - an engine that cannot answer is not healthy
            return False
        finally:
            self.health_check_s += self.clock() - started

    def _rejoin(self, index: int, *, why: str) -> bool:
        """A restarted or recovered engine: live when it serves the pool's version and no update is under way,
        else behind (the next push brings it). False: it failed again right away (still out)."""
        try:
            served = int(self.engines[index].weight_version())
        except Exception as err:  # noqa: BLE001 - it failed again right away
            with self._lock:
                self.states[index], self.reasons[index] = OUT, f"{why}, but its weight version cannot be read: {err}"
            return False
        with self._lock:
            if served == self.version and not self.updating:
                self.states[index], self.reasons[index] = LIVE, ""
            else:
                self.states[index] = BEHIND
                self.reasons[index] = f"serves weight version {served}, the pool {self.version}: waits for the next push"
        logger.warning("rollout engine %s rejoins the pool (%s): %s", self.names[index], why, self.states[index])
        return True

    # ---- failures ------------------------------------------------------------------------------

    def call(self, index: int, fn: Callable[[], Any], *, what: str = "a generation",
             salvage: Optional[Callable[[], Any]] = None, client: Any = None) -> Any:
        """fn() (a call to engine `index`), watched: a transport failure, missed health checks or the
        generation deadline set the engine aside and raise `EngineFailed`; other errors are raised as is.
        salvage: asks the engine to stop the call early (abort its rids); on missed health checks or the
        deadline it is tried first, and what the call then returns is the error's `partial` (stacx.rollout.salvage).
        client: the engine's client fn calls (default: the pool's client of `index` now); a failure of a client
        the pool has replaced since (the engine was restarted meanwhile) is not the new engine's (`fail`)."""
        settings = self.settings
        client = self.engines[index] if client is None else client
        future: Future = self._calls.submit(fn)
        started = self.clock()
        misses = 0
        while True:
            remaining = settings.engine_deadline_s - (self.clock() - started)
            try:
                return future.result(timeout=max(0.0, min(settings.engine_health_interval_s, remaining)))
            except FutureTimeout:
                pass
            except ServerUnavailableError as err:
                error = self.fail(index, f"{what}: {err}", client=client)
                # the outputs a streaming client received before the connection broke (module doc)
                error.partial = getattr(err, "partial", None)
                raise error from err
            if self.clock() - started >= settings.engine_deadline_s:
                raise self._stalled(index, future, salvage, f"{what} ran past the deadline of "
                                                            f"{settings.engine_deadline_s:g} s (--engine-deadline-s)",
                                    client=client)
            misses = 0 if self._healthy(index) else misses + 1
            if misses >= HEALTH_MISSES:
                raise self._stalled(index, future, salvage, f"missed {misses} health checks in a row (every "
                                                            f"{settings.engine_health_interval_s:g} s) during {what}",
                                    client=client)

    def _stalled(self, index: int, future: Future, salvage: Optional[Callable[[], Any]], reason: str, *,
                 client: Any = None) -> EngineFailed:
        """The engine made no progress on a call: ask it to abort the call (salvage) and keep what the call then
        returns (each waited for at most a health interval or SALVAGE_WAIT_S, the longer); then set it aside."""
        partial = None
        if salvage is not None:
            wait_s = max(self.settings.engine_health_interval_s, SALVAGE_WAIT_S)
            try:
                self._calls.submit(salvage).result(timeout=wait_s)
                partial = future.result(timeout=wait_s)
            except Exception:  # noqa: BLE001 - it does not answer the abort either: nothing is kept
                partial = None
        error = self.fail(index, reason + ("; it answered the abort: its tokens so far are kept" if partial is not None
                                           else ""), client=client)
        error.partial = partial
        return error

    def fail(self, index: int, reason: str, *, client: Any = None) -> EngineFailed:
        """Set engine `index` aside (restart it when it can be restarted); returns the error to raise.
        client: the client the failure was seen on; when the pool has replaced it since (a restart finished
        while this call was failing on the old server), the failure is the old engine's and changes nothing:
        the caller re-issues its requests, the new engine is neither set aside nor restarted a second time."""
        with self._lock:
            stale = client is not None and client is not self.engines[index]
            if stale or self.states[index] in (OUT, RESTARTING):
                return EngineFailed(index, self.names[index], reason)
            logger.error("rollout engine %s failed: %s", self.names[index], reason)
            self.generation[index] += 1
            self.failures.append((self.names[index], reason))
            self.reasons[index] = reason
            close = getattr(self.engines[index], "shutdown", None)
            if close is not None:
                try:
                    close()  # a request still retrying against it stops at its next attempt
                except Exception:  # noqa: BLE001 - the engine is gone already
                    pass
            if index in self.attached:
                self.states[index] = OUT
                self.engines_set_aside += 1
                self._out_since[index] = self.clock()
                self._next_probe[index] = self.clock() + self.settings.engine_health_interval_s
                if self.connect is not None:  # the closed client answers nothing: probe through a fresh one
                    try:
                        self.engines[index] = self.connect(index)
                    except Exception:  # noqa: BLE001 - probed through the old one; the failure is reported
                        logger.exception("a new client of rollout engine %s could not be made", self.names[index])
                if self.settings.attached_engine_wait_s > 0:
                    logger.warning("rollout engine %s is attached (the run cannot restart it): it rejoins when its "
                                   "health check passes; with too few engines live the run waits up to %g s for it "
                                   "(--attached-engine-wait-s)", self.names[index],
                                   self.settings.attached_engine_wait_s)
            else:
                self.states[index] = RESTARTING
                self.engine_restarts += 1
                thread = threading.Thread(target=self._restart, args=(index,), daemon=True,
                                          name=f"engine-restart-{index}")
                self._restarts[index] = thread
                thread.start()
        return EngineFailed(index, self.names[index], reason)

    def _restart(self, index: int) -> None:
        try:
            client = self.restart(index)
        except Exception as err:  # noqa: BLE001 - reported in the state, and by EnginesLost if it matters
            logger.error("restarting rollout engine %s failed: %s", self.names[index], err)
            with self._lock:
                self.states[index] = OUT
                self.reasons[index] += f"; its restart failed: {type(err).__name__}: {err}"
            return
        self.engines[index] = client
        self._rejoin(index, why="restarted")

    def wait_for_restarts(self, timeout_s: Optional[float] = None) -> None:
        """Block until every restart under way has finished (a weight push reaches the restarted engines)."""
        with self._lock:
            threads = list(self._restarts.values())
        for thread in threads:
            thread.join(timeout_s)
        with self._lock:  # a restart another thread began meanwhile is kept
            self._restarts = {index: t for index, t in self._restarts.items() if t.is_alive()}

    # ---- weight updates --------------------------------------------------------------------------

    def begin_update(self) -> None:
        self.updating = True

    def push_targets(self) -> list[int]:
        """The engines this update's push goes to (`update_targets`), noted: one that fails after this
        (restarted, it serves the checkpoint's weights) is left out of the version check (`updated_engines`)."""
        targets = self.update_targets()
        self._update_generation = list(self.generation)
        self._pushed = set(targets)
        return targets

    def pushed(self, index: int) -> None:
        """Engine `index` takes this update's push although it failed (and was restarted) during the push."""
        self._update_generation[index] = self.generation[index]
        if self._pushed is not None:
            self._pushed.add(index)

    def updated_engines(self) -> list[int]:
        """The push targets that took this update's push: not failed (restarted) since they were chosen."""
        return [i for i in self.update_targets()
                if (self._pushed is None or i in self._pushed) and self.generation[i] == self._update_generation[i]]

    def update_targets(self) -> list[int]:
        """The engines a weight push goes to: live and behind ones (restarts under way are waited for)."""
        self.wait_for_restarts()
        self._probe_set_aside()
        with self._lock:
            return [i for i, state in enumerate(self.states) if state in (LIVE, BEHIND)]

    def each(self, what: str, action: Callable[[Any], Any], indices: Optional[Sequence[int]] = None) -> dict[int, Any]:
        """{index: action(engine)} over `indices` (default: the update targets), each call watched as `call`
        watches a generation (a hung engine is noticed by its health checks); an engine that fails is set
        aside and left out; other errors are raised."""
        results = {}
        for index in (self.update_targets() if indices is None else indices):
            engine = self.engines[index]
            try:
                results[index] = self.call(index, lambda: action(engine), what=what, client=engine)
            except EngineFailed:
                pass
        return results

    def confirm_version(self, version: int, served: dict[int, int]) -> None:
        """After a push of `version`: the targets that serve it are live; one that does not is a failure."""
        with self._lock:
            self.version = version
            self.updating = False
            for index, got in served.items():
                if got == version:
                    self.states[index], self.reasons[index] = LIVE, ""

    def metrics(self) -> dict[str, float]:
        """rollout/engine_restarts, rollout/engines_set_aside and rollout/engines_rejoined (attached engines that
        failed, and that came back), rollout/requests_reissued and rollout/tokens_salvaged (cumulative),
        rollout/attached_engine_waits and rollout/attached_engine_wait_s (the rollout blocked below
        --min-live-engines for set-aside attached engines: times, seconds; cumulative), rollout/live_engines (now),
        rollout/health_check_s (cumulative seconds of health checks)."""
        with self._lock:
            return {"rollout/engine_restarts": float(self.engine_restarts),
                    "rollout/engines_set_aside": float(self.engines_set_aside),
                    "rollout/engines_rejoined": float(self.engines_rejoined),
                    "rollout/attached_engine_waits": float(self.attached_engine_waits),
                    "rollout/attached_engine_wait_s": float(self.attached_engine_wait_s),
                    "rollout/requests_reissued": float(self.requests_reissued),
                    "rollout/tokens_salvaged": float(self.tokens_salvaged),
                    "rollout/live_engines": float(sum(state == LIVE for state in self.states)),
                    "rollout/health_check_s": float(self.health_check_s)}

    def shutdown(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


def is_transport_failure(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from; a Ray task error included) is a server that did
    not answer, as opposed to a refused request or a bug."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ServerUnavailableError) or type(error).__name__ == "ConnectionError" \
                or getattr(error, "transport_failure", False):  # a torchrun push's error, alike on every rank
            return True
        error = error.__cause__ or error.__context__ or getattr(error, "cause", None)
    return False


def push_failure_action(supervisor: EngineSupervisor, index: int, error: BaseException) -> str:
    """What the trainer does after a weight push to engine `index` failed: 'retry' on it (it answers
    again, or was restarted and waits for these weights), 'skip' it (set aside: it takes the weights
    when it rejoins) or 'raise' (the push was refused or broke: not an engine failure)."""
    if not is_transport_failure(error):
        return "raise"
    if supervisor.states[index] in (LIVE, BEHIND) and supervisor._healthy(index):
        logger.warning("weight push to rollout engine %s failed (%s); it answers its health check: retrying",
                       supervisor.names[index], error)
        return "retry"
    supervisor.fail(index, f"a weight push failed: {error}")
    supervisor.wait_for_restarts()
    if supervisor.states[index] not in (LIVE, BEHIND):
        return "skip"
    supervisor.pushed(index)  # the retried push reaches it: its version is checked with the others'
    return "retry"


def attach_supervisor(pool: Any, rollout: RolloutSection, *, servers: Any,
                      connect: Callable[[str], Any], attached: Sequence[int] = ()) -> EngineSupervisor:
    """Supervise `pool` (an EnginePool) with the run's settings (`rollout`: the RolloutSection); `servers`:
    the servers the run launched (restarted when they have `restart(index) -> url`), None when attached;
    `connect(url)`: a client for a restarted server; `attached`: the pool's engines the run attached beside the
    servers it launched (the last ones: `servers.restart` never sees their indices)."""
    if rollout.min_live_engines > len(pool.engines):
        raise ValueError(f"--min-live-engines {rollout.min_live_engines} is more than the {len(pool.engines)} rollout "
                         "engines of this run; lower it or add engines (--rollout-num-engines, --rollout-urls)")
    def restart_and_connect(index: int) -> Any:
        return connect(servers.restart(index))

    restartable = servers is not None and callable(getattr(servers, "restart", None))
    return pool.supervise(settings=rollout, restart=restart_and_connect if restartable else None,
                          connect=lambda index: connect(pool.names[index]), attached=attached)
