"""Failure detection for calls on role workers: a dead or raising rank fails the driver's call fast.

Every driver call on workers goes through `wait_for_worker_results`, which polls the calls'
object refs with `ray.wait` instead of blocking in `ray.get`. The first rank that raises or
dies ends the wait: the error names the role and rank, and, when one rank's death makes its
peers fail in a collective a moment later, the dead rank is reported as the cause (the
others are listed too). A call that outlives its deadline fails naming the ranks still
running. Nothing here waits without a bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

# After the first failure, how long to wait for other ranks' outcomes so that a dead rank, not
# the peer that saw a broken connection, is named as the cause.
FAILURE_SETTLE_S = 2.0


@dataclass(frozen=True)
class WorkerLabel:
    """Which worker a call ran on."""

    role_name: str
    rank: int

    def __str__(self) -> str:
        return f"role {self.role_name!r} rank {self.rank}"


class RoleWorkerError(RuntimeError):
    """A call on a role worker failed. `role_name`/`rank` name the worker held responsible."""

    def __init__(self, message: str, *, role_name: str | None = None, rank: int | None = None):
        super().__init__(message)
        self.role_name = role_name
        self.rank = rank


class RoleWorkerDied(RoleWorkerError):
    """The worker process exited or was killed during (or before) the call."""


class RoleWorkerRaised(RoleWorkerError):
    """The call raised inside the worker; the message carries the worker's traceback."""


class RoleWorkerTimeout(RoleWorkerError):
    """The call did not finish before its deadline."""


def wait_for_worker_results(
    refs: Sequence[Any],
    labels: Sequence[WorkerLabel],
    *,
    timeout_s: float | None,
    what: str = "call",
    poll_s: float = 0.5,
) -> list[Any]:
    """Results of `refs` in order; raise a `RoleWorkerError` naming the role and rank on failure.

    `labels[i]` names the worker that runs `refs[i]`. `timeout_s=None` waits without a
    deadline but still fails as soon as any rank dies or raises.
    """
    # Imported here: Ray is slow to import (start-up time).
    import ray

    if len(refs) != len(labels):
        raise ValueError(f"{len(refs)} refs but {len(labels)} labels")
    index_of = {ref: index for index, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        failures = []
        for ref in ready:
            index = index_of[ref]
            try:
                results[index] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - classified below
                failures.append((labels[index], err))
        if failures:
            failures += _settle_failures(pending, index_of, labels)
            raise _describe_failures(failures, what)
        if pending and deadline is not None and time.monotonic() >= deadline:
            running = ", ".join(str(labels[index_of[ref]]) for ref in pending)
            first = labels[index_of[pending[0]]]
            raise RoleWorkerTimeout(
                f"{what} did not finish within {timeout_s:.0f}s; still running: {running}",
                role_name=first.role_name,
                rank=first.rank,
            )
    return results


def _settle_failures(pending, index_of, labels) -> list[tuple[WorkerLabel, BaseException]]:
    """Collect outcomes that land within FAILURE_SETTLE_S of the first failure."""
    # Imported here: Ray is slow to import (start-up time).
    import ray

    if not pending:
        return []
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=FAILURE_SETTLE_S)
    failures = []
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as err:  # noqa: BLE001
            failures.append((labels[index_of[ref]], err))
    return failures


def _is_death(err: BaseException) -> bool:
    # Imported here: Ray is slow to import (start-up time).
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError

    return isinstance(err, (RayActorError, ActorDiedError, ActorUnavailableError, WorkerCrashedError))


def _describe_failures(failures, what: str) -> RoleWorkerError:
    deaths = [(label, err) for label, err in failures if _is_death(err)]
    label, err = deaths[0] if deaths else failures[0]
    others = [str(other) for other, _ in failures if other != label]
    also = f" (also failed: {', '.join(others)})" if others else ""
    if deaths:
        # A worker whose start raised (a shipped user file that fails to import) carries that error, with
        # its traceback, at the end of a long message: it is shown whole. Other deaths are cut short.
        text = str(err).strip() if _died_in_its_start(err) else _short(err, keep="head")
        return RoleWorkerDied(f"{what}: worker {label} died{also}: {text}", role_name=label.role_name, rank=label.rank)
    return RoleWorkerRaised(f"{what}: worker {label} raised{also}:\n{_short(err, 4000)}",
                            role_name=label.role_name, rank=label.rank)


def _died_in_its_start(err: BaseException) -> bool:
    """Whether the actor died because its constructor raised (Ray's 'creation task' error)."""
    return "creation task" in str(err)


def _short(err: BaseException, limit: int = 600, keep: str = "tail") -> str:
    """At most `limit` characters; the tail by default, as a traceback's last lines hold the exception."""
    text = str(err).strip()
    if len(text) <= limit:
        return text
    return text[:limit] + " ..." if keep == "head" else "... " + text[-limit:]
