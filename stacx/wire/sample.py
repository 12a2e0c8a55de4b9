"""`Sample`, one trajectory as the driver trains on it, and `Executor`, who produced each of its tokens.

Both ends speak it: the driver's rollouts make samples, and the server's recorded sessions
(stacx.serving.openai_sessions) become samples through the same trajectory rules.
Every per-token field of a `Sample` is aligned with its response tokens (length R); the trainer
pads them with zeros over the prompt when it packs, then CP-slices them with the tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class Executor(enum.IntEnum):
    """Which party produced a token (recorded per token in every sample)."""

    ENVIRONMENT = 0
    """Prompt, observations and chat markup: nobody's action, never trained on."""
    STUDENT = 1
    TEACHER = 2


@dataclass
class Sample:
    """One trajectory. Per-token lists have one entry per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    """Log-probs of the executing engine's sampling distribution (see stacx.wire.types); 0.0
    where the teacher executed (the student's log-prob there is recomputed by the trainer)."""
    loss_mask: list[int]
    """1 on model-generated tokens, 0 on environment tokens (observations, chat markup)."""
    executors: list[int]
    """`Executor` per token: 0 environment, 1 student, 2 teacher."""
    group_index: int = 0
    """Index of the prompt this sample answers (samples of one prompt form a GRPO group)."""
    episode_id: Optional[int] = None
    """The episode this trajectory is a branch of, when one episode gives several samples (an agent session
    that branched, stacx.rollout.agents.agent_trajectories); group-relative advantages count each episode once.
    None: the sample is its own episode."""
    finish_reason: str = "length"
    weight_version: int = 0
    label: Any = None
    metadata: dict = field(default_factory=dict)
    response_text: str = ""
    reward: Optional[float] = None
    reward_error: Optional[str] = None
    teacher_log_probs: Optional[list[float]] = None
    """Teacher log p(token); TEACHER_EXECUTED_SENTINEL (+1.0) where the teacher executed."""
    teacher_top_log_probs: Optional[torch.Tensor] = None
    """[R, K] teacher top-K log-probs (with teacher_top_ids [R, K]) when num_teacher_top_log_probs = K > 0."""
    teacher_top_ids: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    """[len(tokens) - 1, MoE layers, top_k] int32: the experts the engine routed each token to, when the
    rollout asked for them (--use-routing-replay; `GenerateOutput.routed_experts`)."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def to_json(self) -> dict:
        """A JSON-able view for rollout dumps and trajectory corpora."""
        return {
            "prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "response_text": self.response_text,
            "rollout_log_probs": self.rollout_log_probs, "loss_mask": self.loss_mask, "executors": self.executors,
            "reward": self.reward, "reward_error": self.reward_error, "finish_reason": self.finish_reason,
            "weight_version": self.weight_version, "group_index": self.group_index, "episode_id": self.episode_id,
            "label": self.label,
            "metadata": self.metadata, "teacher_log_probs": self.teacher_log_probs,
        }
