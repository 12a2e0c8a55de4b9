"""Policy-gradient actor (GRPO, Dr. GRPO, GSPO, DAPO, CISPO, REINFORCE++, RLOO, PPO's actor).

The loss body arrives with the specializations work; this module fixes the class name and
its place in the recipe catalog (stacx.trainer.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.specializations.base import Specialization


class ActorSpecialization(Specialization):
    """Policy-gradient actor (GRPO, Dr. GRPO, GSPO, DAPO, CISPO, REINFORCE++, RLOO, PPO's actor).

    Per response token: ratio_t = exp(log pi(a_t) - log pi_old(a_t)); loss_t = policy_loss(ratio_t, A_t)
    from the policy-loss registry (ppo_clip, gspo, cispo, ...), aggregated as the run's
    loss_aggregation, plus an optional KL(pi || pi_ref) term and entropy bonus. Needs
    `batch['advantages']`, `old_log_probs`, optional `ref_log_probs`.
    """

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError("ActorSpecialization.compute_loss arrives with the specializations work")
