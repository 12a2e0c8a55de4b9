"""Direct preference optimization on (chosen, rejected) pairs against a frozen reference.

The loss body arrives with the specializations work; this module fixes the class name and
its place in the recipe catalog (stacx.trainer.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.specializations.base import Specialization


class DPOSpecialization(Specialization):
    """Direct preference optimization on (chosen, rejected) pairs against a frozen reference.

    Per pair: loss = -log sigmoid(beta * ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)))),
    with sequence log-probs summed over response tokens; reference log-probs come from the
    in-worker reference.
    """

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError("DPOSpecialization.compute_loss arrives with the specializations work")
