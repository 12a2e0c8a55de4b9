"""Value model for PPO: regresses per-token values onto returns."""

from __future__ import annotations

import torch

from stacx.objectives.advantages_returns import gae_returns
from stacx.objectives.registry import get_loss
from stacx.specializations.base import LossTerms, Specialization


class CriticSpecialization(Specialization):
    """Value model for PPO: regresses per-token values onto returns.

    Per response token: loss_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t +- eps) - R_t)^2)
    (objective `value_clipped`, eps = config.value_clip, None: unclipped). The model output is
    values [T_local] (a value head instead of the language-model head), aligned like logits:
    the value of response token j sits at its prediction position prompt_length - 1 + j.

    Batch: `loss_masks`, `returns` (from `compute_returns`); `values`, the critic's values at
    rollout time (V_old; without it the clip is centred on this forward's detached values).
    Per-token only: no CP communication. Metrics (sums): vf_loss, vf_clipfrac, vf_value.
    """

    outputs_values = True
    base_required_fields = ("returns",)

    def local_values(self, model_output: torch.Tensor, batch) -> torch.Tensor:
        return self._values_local(model_output, batch.layout)

    def per_token_terms(self, view, batch) -> LossTerms:
        old_values = view.cut(batch.values) if batch.values is not None else [v.detach() for v in view.values]
        return LossTerms(*get_loss("value_clipped")(self.config, view.values, old_values, view.cut(batch.returns),
                                                     view.loss_masks))

    @torch.no_grad()
    def compute_values(self, model_output: torch.Tensor, batch) -> list[torch.Tensor]:
        """Values of each WHOLE response [R_i] (no grad; one CP all-gather when cp > 1), e.g. for
        the inject sync that hands `values` to the actor's batch."""
        layout = batch.layout
        return self.whole_responses(self._values_local(model_output, layout).float(), layout)

    def compute_returns(self, rollout_data) -> list[torch.Tensor]:
        """Value targets R_t = A_t + V_t from GAE (config gamma, lam), driver side."""
        return gae_returns(self.config, rollout_data)

    @staticmethod
    def _values_local(model_output: torch.Tensor, layout) -> torch.Tensor:
        values = model_output.squeeze(-1) if model_output.dim() == 2 and model_output.shape[-1] == 1 else model_output
        if values.dim() != 1 or values.shape[0] != layout.num_local_tokens:
            raise ValueError(
                f"critic model_output must be values [T_local={layout.num_local_tokens}] (or [T_local, 1]), "
                f"got {tuple(model_output.shape)}"
            )
        return values
