"""One trajectory builder, and the recorded turns of the OpenAI-compatible endpoint's sessions.

A multi-turn trajectory is built the same way wherever its turns come from: an in-process episode
(stacx.rollout.agents.episode, stacx.rollout.rollin) or a session the endpoint recorded
(`RecordedTurn`, joined by stacx.rollout.agents.agent_trajectories):

    sample = empty_sample(prompt_ids, ...)
    append_generated(sample, output_ids, log_probs)     # the engine's ids: loss mask 1, their log-probs
    close_turn(sample, output_ids, eos)                 # eos (mask 0) when the reply did not end on it
    append_template(sample, observation_ids)            # template and observation ids: mask 0, log-prob 0.0

What the chat template adds between two turns is the one rule of stacx.wire.chat_continuation.
The server records turns (stacx.serving.openai_sessions); the driver joins them into samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from stacx.wire.sample import Executor, Sample

__all__ = ["RecordedTurn", "append_generated", "append_template", "close_turn", "empty_sample"]


def empty_sample(prompt_ids: Sequence[int], **fields: Any) -> Sample:
    """A trajectory of `prompt_ids` with no response yet; `fields` are any other `Sample` fields."""
    return Sample(prompt_ids=list(prompt_ids), response_ids=[], rollout_log_probs=[], loss_mask=[], executors=[],
                  **fields)


def append_generated(sample: Sample, ids: Sequence[int], log_probs: Sequence[float], *,
                     executor: Executor = Executor.STUDENT) -> None:
    """Add ids an engine generated, as generated (never re-tokenized): loss mask 1, `executor` per id,
    `log_probs` the executing engine's (a teacher's turn passes 0.0: the trainer recomputes the student's)."""
    if len(log_probs) != len(ids):
        raise ValueError(f"append_generated: {len(log_probs)} log-probs for {len(ids)} ids")
    sample.response_ids += list(ids)
    sample.rollout_log_probs += list(log_probs)
    sample.loss_mask += [1] * len(ids)
    sample.executors += [int(executor)] * len(ids)


def append_template(sample: Sample, ids: Sequence[int]) -> None:
    """Add ids nobody generated (the chat template's, an observation's): loss mask 0, executor
    ENVIRONMENT, rollout log-prob 0.0."""
    sample.response_ids += list(ids)
    sample.rollout_log_probs += [0.0] * len(ids)
    sample.loss_mask += [0] * len(ids)
    sample.executors += [int(Executor.ENVIRONMENT)] * len(ids)


def close_turn(sample: Sample, generated_ids: Sequence[int], end_of_turn: int) -> None:
    """End an assistant turn whose ids were `generated_ids`: `end_of_turn` as a template id (mask 0)
    unless the engine generated it last itself."""
    if not generated_ids or generated_ids[-1] != end_of_turn:
        append_template(sample, [end_of_turn])


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
