"""`RolloutPlan`: what the rollout needs to know about the run's recipe, built by the trainer.

The rollout never reads the recipe (`TrainingConfig`) itself: the trainer hands it this plan
(`stacx.trainer.config.rollout_plan.rollout_plan`) together with the run-config sections it reads
(`stacx.rollout.sections`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stacx.rollout.rollin import RollInSpec


@dataclass(frozen=True, kw_only=True)
class RolloutPlan:
    """How a run of one recipe samples."""

    recipe: str
    """The recipe's name (error messages and warnings name it)."""
    data_source: str
    """'rollout' (samples from the engine) or 'dataset' (trains on fixed rows, samples nothing)."""
    uses_teacher: bool = False
    """Rollouts are scored by a teacher server (per-token teacher log-probs)."""
    uses_reward: bool = False
    """Rollouts are scored by the reward function (the uniform-reward warning watches them)."""
    rollin_protocol: Optional[str] = None
    """The recipe's roll-in protocol ('beta_mixture', 'aggrevate', 'teacher_relabel'): the teacher
    acts in some turns; None: the student acts in every turn."""
    rollin: Optional[RollInSpec] = None
    """The resolved roll-in (mode and schedule; 'student' without a protocol); None when the run
    replays a teacher trajectory corpus instead of sampling."""

    @property
    def samples_rollouts(self) -> bool:
        return self.data_source == "rollout"
