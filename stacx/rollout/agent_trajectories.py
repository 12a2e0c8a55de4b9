"""An external agent's recorded turns -> training samples (token-in/token-out).

The OpenAI-compatible endpoint records, per session, every turn the engine served: the prompt ids
it was given, the ids it generated, their log-probs and the weight version (`RecordedTurn`).
When a turn continues the previous one (the server extends the previous prompt + output with the
ids the chat template makes for the new messages, see stacx.rollout.engines.openai_sessions), its
prompt starts with the previous turn's prompt and output, and the turns join into one trajectory:

    prompt   = P_0
    response = O_0  B_1  O_1  B_2  O_2 ...      B_k = P_k[len(P_{k-1}) + len(O_{k-1}):]
    loss_mask:  1..  0..  1..  0..  1..          (1 on generated ids only)
    rollout_log_probs: the engine's on O_k, 0.0 on B_k

The trained ids are exactly the ids the engine produced and the ids the template made between
turns: nothing is re-tokenized. A turn whose prompt does not extend the previous one (the agent
rewrote or truncated its history) starts a new trajectory, so a session gives one sample per
unbroken run of turns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from stacx.rollout.dagger import Executor
from stacx.rollout.manager import Sample

__all__ = ["RecordedTurn", "assemble_trajectories"]


@dataclass(frozen=True, kw_only=True)
class RecordedTurn:
    """One engine call of a session, as the endpoint recorded it."""

    prompt_ids: tuple[int, ...]
    """Every id the engine was given (the whole conversation so far)."""
    output_ids: tuple[int, ...]
    """The ids it generated (a stop token included when it stopped on one)."""
    output_log_probs: tuple[float, ...]
    """The engine's sampling log-prob of each output id (stacx.rollout.types states the convention)."""
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


def continues(turn: RecordedTurn, previous: RecordedTurn) -> bool:
    """True when `turn`'s prompt is `previous`'s prompt and output followed by more ids."""
    head = previous.prompt_ids + previous.output_ids
    return len(turn.prompt_ids) >= len(head) and turn.prompt_ids[:len(head)] == head


def assemble_trajectories(turns: Sequence[RecordedTurn], *, group_index: int = 0) -> list[Sample]:
    """The session's turns, in order, as one `Sample` per unbroken run of turns (module doc).

    Each sample's `weight_version` is the oldest version among its turns; `metadata` holds
    `turn_weight_versions` (one per turn), `num_turns` and `last_turn_start` (where the last turn's
    output begins in `response_ids`: what a reward of the final answer reads)."""
    samples: list[Sample] = []
    last_turns: list[RecordedTurn] = []  # per sample, its last turn
    for turn in turns:
        # A turn continues the latest trajectory it extends: the last one, or, after a request of n > 1
        # samples (each its own trajectory), the one of the sample the agent kept.
        at = next((i for i in range(len(samples) - 1, -1, -1) if continues(turn, last_turns[i])), None)
        if at is None:
            sample = Sample(prompt_ids=list(turn.prompt_ids), response_ids=[], rollout_log_probs=[], loss_mask=[],
                            executors=[], group_index=group_index, weight_version=turn.weight_version,
                            metadata={"num_turns": 0, "turn_weight_versions": []})
            samples.append(sample)
            last_turns.append(turn)
            at = len(samples) - 1
        else:
            sample, previous = samples[at], last_turns[at]
            between = turn.prompt_ids[len(previous.prompt_ids) + len(previous.output_ids):]
            sample.response_ids += between
            sample.rollout_log_probs += [0.0] * len(between)
            sample.loss_mask += [0] * len(between)
            sample.executors += [int(Executor.ENVIRONMENT)] * len(between)
        sample.metadata["last_turn_start"] = len(sample.response_ids)
        sample.response_ids += turn.output_ids
        sample.rollout_log_probs += turn.output_log_probs
        sample.loss_mask += [1] * len(turn.output_ids)
        sample.executors += [int(Executor.STUDENT)] * len(turn.output_ids)
        sample.weight_version = min(sample.weight_version, turn.weight_version)
        sample.finish_reason = turn.finish_reason
        sample.metadata["num_turns"] += 1
        sample.metadata["turn_weight_versions"].append(turn.weight_version)
        last_turns[at] = turn
    return samples
