"""Supervised cross-entropy on response tokens (SFT, iterative SFT / online DAgger)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from stacx.objectives.registry import get_loss
from stacx.specializations.base import Specialization, full_token_counts


class CausalDecoderSpecialization(Specialization):
    """Supervised cross-entropy on response tokens (SFT, iterative SFT / online DAgger).

    Per token t of a response: loss_t = -log pi(y_t | y_<t, x), masked by `loss_masks` and
    reduced by the framework's reducer (token-mean: sum over tokens / global token count).
    Batch: `layout`, `tokens`, `loss_masks`. Per-token only: no CP communication.
    Metrics (sums): `nll`, `num_loss_tokens`, `num_sequences`.
    """

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.check_reducer(reducer)
        layout = self.check_batch(batch)
        log_probs_local, _ = self.token_log_probs(model_output, batch)
        view = self.response_view(layout, log_probs_local, whole=False)
        masks = view.field(batch, "loss_masks", dtype=torch.float32)
        per_token, metrics = get_loss("sft_cross_entropy")(self.config, view.values, masks)
        loss = reducer(per_token, masks, sequence_token_counts=full_token_counts(batch["loss_masks"]))
        metrics.update(view.count_metrics(masks, batch["loss_masks"]))
        return loss, metrics
