"""An external agent's recorded turns -> training samples (token-in/token-out), one per branch.

The OpenAI-compatible endpoint records, per session, every turn the engine served: the prompt ids
it was given, the ids it generated, their log-probs and the weight version (`RecordedTurn`).
When a turn continues an earlier one (the server extends that turn's prompt + output with the ids
the chat template makes for the new messages, see stacx.serving.openai_sessions), its
prompt starts with the earlier turn's prompt and output, and the turns join into one trajectory:

    prompt   = P_0
    response = O_0  B_1  O_1  B_2  O_2 ...      B_k = P_k[len(P_{k-1}) + len(O_{k-1}):]
    loss_mask:  1..  0..  1..  0..  1..          (1 on generated ids only)
    rollout_log_probs: the engine's on O_k, 0.0 on B_k

The trained ids are exactly the ids the engine produced and the ids the template made between
turns: nothing is re-tokenized.

A session is a tree. A turn whose prompt does not extend any trajectory's ids (a scaffold dropped
its reply after a format error and asked again, compacted its history, or started a sub-agent)
*branches*: it starts a new trajectory whose prompt is its own prompt ids, and it records where it
left the episode's tree: `branch_of` (the index of the trajectory sharing the longest common prefix
of ids with it, None when it shares none) and `branch_point` (that prefix's length). Every
generated id is trained in exactly one trajectory (a branch repeats its parent's ids only as
prompt, loss mask 0), and every trajectory of a session is a sample of the one episode: the same
reward, group index and `episode_id` (how the group-relative advantages count an episode once,
stacx.objectives.advantages_group).
"""

from __future__ import annotations

from typing import Optional, Sequence

from stacx.wire.sample import Sample
from stacx.wire.trajectories import RecordedTurn, append_generated, append_template, empty_sample

__all__ = ["assemble_trajectories", "branch_metrics", "common_prefix_length"]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def assemble_trajectories(turns: Sequence[RecordedTurn], *, group_index: int = 0,
                          episode_id: Optional[int] = None) -> list[Sample]:
    """The session's turns, in order, as one `Sample` per branch of its tree (module doc).

    A turn continues the trajectory whose ids (last prompt + output) are the longest prefix of its
    prompt; with none, it branches. Each sample's `weight_version` is the oldest version among its
    turns; `metadata` holds `turn_weight_versions` (one per turn), `num_turns`, `last_turn_start`
    (where the last turn's output begins in `response_ids`: what a reward of the final answer reads),
    `branch_of` and `branch_point` (None and 0 for the first trajectory)."""
    samples: list[Sample] = []
    for turn in turns:
        sample = _continued(samples, turn.prompt_ids)
        if sample is None:
            parent, shared = None, 0
            for index, other in enumerate(samples):
                length = common_prefix_length(other.tokens, turn.prompt_ids)
                if length > shared:
                    parent, shared = index, length
            sample = empty_sample(turn.prompt_ids, group_index=group_index, weight_version=turn.weight_version,
                                  episode_id=episode_id,
                                  metadata={"num_turns": 0, "turn_weight_versions": [], "branch_of": parent,
                                            "branch_point": shared})
            samples.append(sample)
        else:
            append_template(sample, turn.prompt_ids[len(sample.tokens):])
        sample.metadata["last_turn_start"] = len(sample.response_ids)
        append_generated(sample, turn.output_ids, turn.output_log_probs)
        sample.weight_version = min(sample.weight_version, turn.weight_version)
        sample.finish_reason = turn.finish_reason
        sample.metadata["num_turns"] += 1
        sample.metadata["turn_weight_versions"].append(turn.weight_version)
    return samples


def _continued(samples: Sequence[Sample], prompt_ids: Sequence[int]) -> Optional[Sample]:
    """The trajectory whose ids are the longest prefix of `prompt_ids` (None: a branch)."""
    best = None
    for sample in samples:
        length = len(sample.prompt_ids) + len(sample.response_ids)
        if length <= len(prompt_ids) and (best is None or length > best[0]) \
                and tuple(prompt_ids[:length]) == tuple(sample.tokens):
            best = (length, sample)
    return None if best is None else best[1]


def branch_metrics(episodes: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """Rollout metrics of the episodes' trees: `rollout/agent_branches_per_episode` (trajectories beyond
    the first, averaged over episodes with a sample: 0.0 when no request broke off its path) and
    `rollout/agent_tokens_reprefilled` (the step's ids that branches repeat from the trajectory they
    left, `branch_point` summed: the trainer forwards them again)."""
    recorded = [samples for samples in episodes if samples]
    branches = sum(len(samples) - 1 for samples in recorded)
    repeated = sum(int(s.metadata.get("branch_point", 0)) for samples in recorded for s in samples)
    return {"rollout/agent_branches_per_episode": branches / len(recorded) if recorded else 0.0,
            "rollout/agent_tokens_reprefilled": float(repeated)}
