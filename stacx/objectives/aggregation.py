"""Loss aggregation: from per-token losses to (sum, global count) and padded helpers.

Stacx reduces every loss the same way: each micro-batch contributes a SUM, and the framework
divides by a GLOBAL count (tokens or samples over the whole step, all DP/CP ranks and
micro-batches), known before the first backward. The gradient then does not depend on how the
batch was split. For trajectory i with per-token loss l_it and mask m_it (n_i = sum_t m_it):

| mode                       | micro-batch sum S                  | global count N        |
| -------------------------- | ---------------------------------- | --------------------- |
| `token-mean`               | sum_i sum_t m_it l_it              | tokens: sum_i n_i     |
| `seq-mean-token-mean`      | sum_i (sum_t m_it l_it) / n_i      | samples with n_i > 0  |
| `seq-mean-token-sum`       | sum_i sum_t m_it l_it              | samples with n_i > 0  |
| `seq-mean-token-sum-norm`  | sum_i (sum_t m_it l_it) / L_norm   | samples with n_i > 0  |

L_norm (`seq_norm_len`) is a constant (e.g. the maximum response length, Dr. GRPO); it must be
given, because a length measured on the micro-batch would make the loss depend on the split.
Count the normalizer on the masks *before* off-policy masking (`raw_loss_masks`), so it is
known before the forward pass. The loss is S_total / N with S_total summed over everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from stacx.objectives.registry import AGGREGATIONS
from stacx.objectives.validation import check_trajectory_lists

TOKENS = "tokens"
SAMPLES = "samples"


@dataclass(frozen=True)
class AggregationMode:
    """How one trajectory contributes to the micro-batch sum, and what the global count counts."""

    name: str
    normalizer: str
    """`tokens` (sum of loss-mask entries) or `samples` (trajectories with any loss token)."""
    trajectory_sum: Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]
    """(per-token losses (T,), mask (T,), seq_norm_len) -> scalar contribution."""
    needs_seq_norm_len: bool = False


def _token_sum(loss, mask, _norm_len):
    return (loss * mask).sum()


def _token_mean(loss, mask, _norm_len):
    return (loss * mask).sum() / mask.sum().clamp_min(1e-8)


def _token_sum_norm(loss, mask, norm_len):
    return (loss * mask).sum() / norm_len


for _mode in (
    AggregationMode("token-mean", TOKENS, _token_sum),
    AggregationMode("seq-mean-token-mean", SAMPLES, _token_mean),
    AggregationMode("seq-mean-token-sum", SAMPLES, _token_sum),
    AggregationMode("seq-mean-token-sum-norm", SAMPLES, _token_sum_norm, needs_seq_norm_len=True),
):
    AGGREGATIONS.register(_mode.name)(_mode)


def get_aggregation_mode(mode: str) -> AggregationMode:
    """The `AggregationMode` for a name; unknown names list the known ones."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known modes: {AGGREGATIONS.names()}")
    return AGGREGATIONS.get(mode)


def normalizer_kind(mode: str) -> str:
    """What the global count of `mode` counts: `"tokens"` or `"samples"`."""
    return get_aggregation_mode(mode).normalizer


def count_normalizer(loss_masks: Sequence[torch.Tensor], mode: str) -> torch.Tensor:
    """This micro-batch's share of the global count (float64 scalar); sum it over all ranks.

    tokens: sum_i sum_t m_it; samples: #{i : sum_t m_it > 0}.
    """
    check_trajectory_lists("loss_masks", loss_masks)
    kind = normalizer_kind(mode)
    if not loss_masks:
        return torch.zeros((), dtype=torch.float64)
    per_trajectory = torch.stack([m.detach().to(torch.float64).sum() for m in loss_masks])
    if kind == TOKENS:
        return per_trajectory.sum()
    return (per_trajectory > 0).sum().to(torch.float64)


def aggregate_sum(
    per_token_losses: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    mode: str,
    seq_norm_len: float | None = None,
) -> torch.Tensor:
    """Micro-batch sum S of `mode` (see the module table); the caller divides by the global N.

    per_token_losses, loss_masks: lists of (response_len_i,) tensors. Returns a scalar that
    carries gradients. Trajectories with no loss tokens contribute exactly 0.
    """
    check_trajectory_lists("per_token_losses", per_token_losses, loss_masks=loss_masks)
    spec = get_aggregation_mode(mode)
    if spec.needs_seq_norm_len and (seq_norm_len is None or seq_norm_len <= 0):
        raise ValueError(f"loss_agg_mode {mode!r} needs a positive seq_norm_len, got {seq_norm_len!r}")
    if not per_token_losses:
        return torch.zeros(())
    parts = [spec.trajectory_sum(loss, mask.to(loss.dtype), seq_norm_len) for loss, mask in zip(per_token_losses, loss_masks)]
    return torch.stack(parts).sum()


def aggregate_mean(
    per_token_losses: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    mode: str,
    seq_norm_len: float | None = None,
) -> torch.Tensor:
    """Single-process reference: `aggregate_sum / count_normalizer` on these trajectories only."""
    total = aggregate_sum(per_token_losses, loss_masks, mode, seq_norm_len)
    count = count_normalizer(loss_masks, mode).to(total.dtype)
    return total / count.clamp_min(1.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / sum(mask) over `dim` (all elements when None); 0 where mask is empty."""
    if values.shape != mask.shape:
        raise ValueError(f"masked_mean: values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1e-8)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask): the metric form the framework expects (it divides by the global count)."""
    return (values * mask.to(values.dtype)).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    seq_norm_len: float | None = None,
) -> torch.Tensor:
    """Aggregate a padded (batch, seq_len) loss over this batch only (for plugin authors).

    Same modes and conventions as `aggregate_sum` / `count_normalizer`, normalized locally.
    `seq-mean-token-sum-norm` defaults `seq_norm_len` to the padded length seq_len.
    """
    if loss_mat.dim() != 2 or loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must be the same (batch, seq_len) shape"
        )
    if mode == "seq-mean-token-sum-norm" and seq_norm_len is None:
        seq_norm_len = loss_mat.shape[1]
    return aggregate_mean(list(loss_mat.unbind(0)), list(loss_mask.unbind(0)), mode, seq_norm_len)
