"""A weight push under torchrun ends alike on every rank, so a push that failed on one engine can be retried.

The ranks of a torchrun job take part in a push together (TP and expert gathers; one rank sends). If the
sending rank's HTTP call fails and only that rank raised, the others would wait in the next collective
forever. So the sender drains its buckets (the gathers stay matched, `RoleRuntime.push_weights_to_engine`),
every rank's outcome is all-gathered, and every rank raises the same `WeightPushFailed` when any failed:

    outcomes = all_gather_values(push_outcome(lambda: runtime.push_weights_to_engine(...)))
    sent = settle_push(outcomes, url=url)       # tensors sent per rank, or WeightPushFailed on every rank

The loop then asks the rollout service on rank 0 what to do (retry on the restarted or recovered engine,
skip a set-aside one, or raise), shares the answer, and every rank follows it (`StacxTrainer.push_weights_to`).
"""

from __future__ import annotations

from typing import Callable

from stacx.rollout.engine_health import is_transport_failure


class WeightPushFailed(RuntimeError):
    """A weight push failed on some rank; raised on every rank alike. `transport_failure`: the engine did not
    answer (an engine failure the rollout service may recover from), not a refused or broken push."""

    def __init__(self, message: str, *, transport_failure: bool):
        super().__init__(message)
        self.transport_failure = transport_failure


def push_outcome(push: Callable[[], int]) -> dict:
    """{"sent": tensors sent} of `push()`, or {"sent": 0, "error": what failed, "transport": whether the
    engine did not answer} when it raised an Exception (plain values: they travel as rank messages)."""
    try:
        return {"sent": int(push()), "error": None, "transport": False}
    except Exception as err:  # noqa: BLE001 - every rank learns of it and raises the same error
        return {"sent": 0, "error": f"{type(err).__name__}: {err}", "transport": is_transport_failure(err)}


def settle_push(outcomes: list[dict], *, url: str) -> list[int]:
    """Tensors sent per rank when every rank's push succeeded; else `WeightPushFailed` naming each failed rank."""
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome["error"] is not None]
    if not failed:
        return [outcome["sent"] for outcome in outcomes]
    detail = "; ".join(f"rank {rank}: {outcome['error']}" for rank, outcome in failed)
    raise WeightPushFailed(f"weight push to {url} failed ({detail})",
                           transport_failure=all(outcome["transport"] for _, outcome in failed))
