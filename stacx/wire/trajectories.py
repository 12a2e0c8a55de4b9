"""Recorded turns: what the OpenAI-compatible endpoint keeps of each engine call of a session.

The server records them (stacx.serving.openai_sessions); the driver joins them into training samples
(stacx.rollout.agents.agent_trajectories).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RecordedTurn:
    """One engine call of a session, as the endpoint recorded it."""

    prompt_ids: tuple[int, ...]
    """Every id the engine was given (the whole conversation so far)."""
    output_ids: tuple[int, ...]
    """The ids it generated (a stop token included when it stopped on one)."""
    output_log_probs: tuple[float, ...]
    """The engine's sampling log-prob of each output id (stacx.wire.types states the convention)."""
    weight_version: int
    """The policy version that generated `output_ids`."""
    finish_reason: str = "stop"

    def __post_init__(self):
        if len(self.output_log_probs) != len(self.output_ids):
            raise ValueError(f"RecordedTurn: {len(self.output_log_probs)} output_log_probs for "
                             f"{len(self.output_ids)} output_ids")
        if not self.prompt_ids:
            raise ValueError("RecordedTurn: prompt_ids is empty")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "RecordedTurn":
        return cls(prompt_ids=tuple(int(t) for t in row["prompt_ids"]),
                   output_ids=tuple(int(t) for t in row["output_ids"]),
                   output_log_probs=tuple(float(lp) for lp in row["output_log_probs"]),
                   weight_version=int(row["weight_version"]), finish_reason=str(row.get("finish_reason", "stop")))
