"""Failed episodes: an infrastructure failure is retried, then dropped, and its group replaced.

    try: ...
    except Exception as err:
        cause = infrastructure_cause(err)     # 'sandbox', 'tool_transport', 'agent_program', 'reward', or None

An episode fails for an **infrastructure** reason when something outside the policy breaks:
- its sandbox server does not answer, fails a request (5xx) or lost the session (a restart): the sandbox's
  `SandboxUnavailableError` and `SandboxServerError`, which declare `infrastructure_cause = "sandbox"`;
- a tool's transport fails (a tool raising `InfrastructureError("tool_transport", ...)`);
- an agent program crashes for a reason it reports as not the policy's (`--agent-command` exiting with
  `AGENT_INFRASTRUCTURE_EXIT_CODE`, 75 = EX_TEMPFAIL, or an `--agent` function raising `InfrastructureError`);
- a reward call fails (the reward function raising `InfrastructureError`, or any error declaring an
  `infrastructure_cause`, or a connection error or timeout of an HTTP call it makes).
Any exception with an `infrastructure_cause` attribute (a string) declares itself one, so packages that never
import the rollout (the sandbox) can say so. Everything else is the **policy's**: a bad action, a malformed
tool call, a command or an agent that ran past its time limit, a test that fails. Those end the episode as
today (an error observation, reward 0) and are never retried.

An infrastructure failure is retried up to `--episode-retries` times (the episode plays again from its
prompt, counted in `rollout/episodes_retried`); when every try fails it is dropped. A group with a dropped
member is replaced by a fresh prompt's group (`rollout/groups_replaced`), so the step keeps its batch size and
GRPO's group statistics are over complete groups only. A step whose dropped episodes exceed
`--max-dropped-fraction` of the episodes it played stops the run (`EpisodeLossError`, naming the causes).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

CAUSES = ("sandbox", "tool_transport", "agent_program", "reward")
AGENT_INFRASTRUCTURE_EXIT_CODE = 75
"""The exit status by which an --agent-command program says it failed for a reason outside the policy
(sysexits' EX_TEMPFAIL): the episode is played again."""
DROPPED_KEY = "dropped"
"""`Sample.metadata[DROPPED_KEY]`: why the episode was dropped (its last infrastructure failure)."""
MAX_REPLACEMENT_ROUNDS = 4
"""Rounds of fresh prompts drawn to replace dropped groups before the step gives up."""


class InfrastructureError(RuntimeError):
    """An episode failed for a reason outside the policy (module doc); `cause` is one of CAUSES."""

    def __init__(self, cause: str, message: str):
        if cause not in CAUSES:
            raise ValueError(f"InfrastructureError cause {cause!r} is unknown; known: {list(CAUSES)}")
        self.infrastructure_cause = cause
        super().__init__(f"{cause}: {message}")


class EpisodeLossError(RuntimeError):
    """Too many of a step's episodes were dropped (--max-dropped-fraction); the message names the causes."""


def infrastructure_cause(error: Optional[BaseException]) -> Optional[str]:
    """The infrastructure cause `error` declares (or an error it was raised from), else None: the policy's."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        cause = getattr(error, "infrastructure_cause", None)
        if isinstance(cause, str) and cause:
            return cause
        error = error.__cause__ or error.__context__
    return None


def reward_infrastructure_cause(error: BaseException) -> Optional[str]:
    """A reward call's failure: a declared cause, or an HTTP connection error or timeout ('reward')."""
    cause = infrastructure_cause(error)
    if cause is not None:
        return cause
    # Imported here: requests is only needed to classify a failed reward call.
    import requests

    return "reward" if isinstance(error, (requests.ConnectionError, requests.Timeout)) else None


def retrying_reward(reward_fn: Callable, retries: int) -> Callable:
    """`reward_fn` called again (up to `retries` more times) when a call fails for an infrastructure reason;
    the last failure is raised as `InfrastructureError` (so the sample is dropped, `is_dropped`). The
    function's attributes (batched, timeout, needs_label) are kept. `retries` 0: the function itself."""
    if retries <= 0 or reward_fn is None:
        return reward_fn

    @functools.wraps(reward_fn)
    def call(*args, **kwargs):
        for attempt in range(retries + 1):
            try:
                return reward_fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - classified below, re-raised when it is the policy's
                cause = reward_infrastructure_cause(err)
                if cause is None:
                    raise
                if attempt == retries:
                    raise InfrastructureError("reward", f"the reward call failed {retries + 1} times; last: "
                                                        f"{type(err).__name__}: {err}") from err
                logger.warning("reward call failed (%s: %s); retrying (%d/%d)", type(err).__name__, err,
                               attempt + 1, retries)
        raise AssertionError("unreachable")

    return call


def is_dropped(sample: Any) -> Optional[str]:
    """Why `sample` was dropped ('' -> None when it was not): an episode out of retries, or a reward call
    that failed for an infrastructure reason every time."""
    reason = (getattr(sample, "metadata", None) or {}).get(DROPPED_KEY)
    if reason:
        return str(reason)
    error = getattr(sample, "reward_error", None) or ""
    return error if error.startswith(InfrastructureError.__name__) else None


def groups_of(samples: Sequence[Any]) -> list[list[Any]]:
    """Samples by group_index, in first-seen order."""
    groups: dict[int, list] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


def replace_dropped_groups(samples: Sequence[Any], draw: Callable[[int], Sequence[Any]], *, num_groups: int,
                           max_dropped_fraction: float, step: int) -> tuple[list[Any], dict[str, float]]:
    """`num_groups` complete groups: groups of `samples` with a dropped member are left out and replaced by
    groups of fresh prompts (`draw(k)` plays k more prompts' groups); group indices renumbered 0.. in order.
    Returns (samples, {rollout/groups_replaced, rollout/episodes_dropped}); raises `EpisodeLossError` when the
    dropped episodes exceed `max_dropped_fraction` of those played, or fresh prompts keep failing."""
    kept: list[list[Any]] = []
    played, reasons, replaced = 0, Counter(), 0
    batch = list(samples)
    for round_index in range(MAX_REPLACEMENT_ROUNDS + 1):
        for group in groups_of(batch):
            played += len(group)
            dropped = [reason for reason in map(is_dropped, group) if reason]
            if dropped:
                reasons.update(_short(reason) for reason in dropped)
                continue
            if len(kept) < num_groups:
                kept.append(group)
        check_dropped_fraction(sum(reasons.values()), played, max_dropped_fraction, reasons, step=step)
        missing = num_groups - len(kept)
        if missing <= 0:
            break
        if round_index == MAX_REPLACEMENT_ROUNDS:
            raise EpisodeLossError(f"step {step}: {missing} of {num_groups} groups still have dropped episodes after "
                                   f"{MAX_REPLACEMENT_ROUNDS} rounds of fresh prompts; causes: {_causes(reasons)}")
        replaced += missing
        logger.warning("step %d: replacing %d group(s) with a dropped episode by fresh prompts (%s)", step, missing,
                       _causes(reasons))
        batch = list(draw(missing))
    out = []
    for index, group in enumerate(kept):
        for sample in group:
            sample.group_index = index
            out.append(sample)
    return out, {"rollout/groups_replaced": float(replaced), "rollout/episodes_dropped": float(sum(reasons.values()))}


def check_dropped_fraction(dropped: int, played: int, max_fraction: float, reasons: Counter, *, step: int) -> None:
    if played and dropped / played > max_fraction:
        raise EpisodeLossError(
            f"step {step}: {dropped} of {played} episodes were dropped after their retries ({dropped / played:.0%}, "
            f"more than --max-dropped-fraction {max_fraction:g}); causes: {_causes(reasons)}. Fix what fails (the "
            "sandbox server, the reward service, the agent program), or raise --episode-retries / "
            "--max-dropped-fraction")


def _short(reason: str) -> str:
    return reason if len(reason) <= 200 else reason[:200] + "..."


def _causes(reasons: Counter) -> str:
    return "; ".join(f"{count} x {reason}" for reason, count in reasons.most_common(3)) or "none"


def retry_failed(items: list, *, failure: Callable[[Any], Optional[str]], replay: Callable[[list], list],
                 retries: int) -> tuple[list, int]:
    """(items, how many were played again): up to `retries` rounds, the items whose `failure(item)` is set
    are replaced by `replay(failed)` (fresh plays, in the same order); those still failing stay (dropped)."""
    items = list(items)
    retried = 0
    for _ in range(max(0, retries)):
        failed = [index for index, item in enumerate(items) if failure(item)]
        if not failed:
            break
        for index in failed:
            logger.warning("episode failed for an infrastructure reason (%s); playing it again", failure(items[index]))
        fresh = replay([items[index] for index in failed])
        retried += len(failed)
        for index, item in zip(failed, fresh):
            items[index] = item
    return items, retried
