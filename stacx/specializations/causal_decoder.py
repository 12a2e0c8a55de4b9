"""Supervised cross-entropy on response tokens (SFT, iterative SFT / online DAgger)."""

from __future__ import annotations

from stacx.objectives.registry import get_loss
from stacx.specializations.base import LossTerms, Specialization


class CausalDecoderSpecialization(Specialization):
    """Supervised cross-entropy on response tokens (SFT, iterative SFT / online DAgger).

    Per token t of a response: loss_t = -log pi(y_t | y_<t, x), masked by `loss_masks` and
    reduced by the framework's reducer (token-mean: sum over tokens / global token count).
    Batch: `loss_masks`. Per-token only: no CP communication.
    Metrics (sums): `nll`, `num_loss_tokens`, `num_sequences`.
    """

    def per_token_terms(self, view, batch) -> LossTerms:
        return LossTerms(*get_loss("sft_cross_entropy")(self.config, view.values, view.loss_masks))
