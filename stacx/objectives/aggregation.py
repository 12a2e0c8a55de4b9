"""Loss aggregation modes: the one definition of each mode's per-sequence weight.

Stacx reduces every loss the same way: each micro-batch contributes a SUM, and the framework
divides by a GLOBAL count (tokens or samples over the whole step, all DP/CP ranks and
micro-batches), known before the first backward. The gradient then does not depend on how the
batch was split. For trajectory i with per-token loss l_it and mask m_it, a mode is a per-
sequence factor f(n_i, L_norm) and a normalizer kind; the micro-batch sum and the global count are

    S = sum_i f(n_i, L_norm) * sum_t m_it l_it        N = sum_i n_i (tokens) or #{i : n_i > 0} (samples)

and the loss is S_total / N, i.e. L = sum_i w_i sum_t m_it l_it with w_i = f(n_i, L_norm) / N
(`AggregationMode.sequence_weight`, what `stacx.parallel.reduction.Reducer` applies):

| mode                       | f(n_i, L_norm) | global count N        | w_i                  |
| -------------------------- | -------------- | --------------------- | -------------------- |
| `token-mean`               | 1              | tokens: sum_i n_i     | 1 / N_tok            |
| `seq-mean-token-mean`      | 1 / n_i        | samples with n_i > 0  | 1 / (N_seq * n_i)    |
| `seq-mean-token-sum`       | 1              | samples with n_i > 0  | 1 / N_seq            |
| `seq-mean-token-sum-norm`  | 1 / L_norm     | samples with n_i > 0  | 1 / (N_seq * L_norm) |

Token-count convention (the only one in Stacx, `loss_token_count`): n_i is the NUMBER of
non-zero loss-mask entries of the whole sequence i, never the sum of mask values. A mask value
still weights its token inside sum_t m_it l_it; for the usual 0/1 masks both readings agree.

L_norm (`seq_norm_len`) is a constant (e.g. the maximum response length, Dr. GRPO); it must be
given, because a length measured on the micro-batch would make the loss depend on the split.
Count the normalizer on the masks *before* off-policy masking (`raw_loss_masks`), so it is
known before the forward pass.

A custom mode is registered once and then works in `aggregate_sum`, `count_normalizer` and the
distributed `Reducer` alike:

    register_aggregation_mode(AggregationMode("seq-mean-token-sqrt", SAMPLES, lambda n, _l: n.rsqrt()))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from stacx.objectives.registry import AGGREGATIONS
from stacx.objectives.validation import check_trajectory_lists

TOKENS = "tokens"
SAMPLES = "samples"
NORMALIZER_KINDS = (TOKENS, SAMPLES)


def loss_token_count(mask: torch.Tensor) -> torch.Tensor:
    """n_i of one mask (any shape): the number of non-zero entries, as an int64 scalar tensor."""
    return (mask.detach() != 0).sum()


def loss_token_counts(loss_masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """n_i of each mask: [S] int64 (`loss_token_count` of each; empty for no masks). The one
    token-count helper: step counts, reducer weights and count metrics all come from it."""
    if not loss_masks:
        return torch.zeros(0, dtype=torch.long)
    return torch.stack([loss_token_count(torch.as_tensor(m)) for m in loss_masks])


@dataclass(frozen=True)
class AggregationMode:
    """One loss aggregation mode: a per-sequence factor f and what the global count N counts."""

    name: str
    normalizer: str
    """`tokens` (loss tokens, see `loss_token_count`) or `samples` (trajectories with n_i > 0)."""
    sequence_factor: Callable[[torch.Tensor, float | None], torch.Tensor]
    """(n_i [S] float64, all >= 1, L_norm) -> f [S] float64. Only called for n_i > 0; the
    framework gives trajectories without loss tokens weight 0."""
    needs_seq_norm_len: bool = False
    """The factor uses L_norm, which must then be a positive constant."""
    needs_whole_sequence_token_counts: bool = True
    """The factor uses n_i, so under context parallelism the caller must pass each WHOLE
    sequence's count (a CP rank's mask sees only part of the sequence)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"aggregation mode name must be a non-empty string, got {self.name!r}")
        if self.normalizer not in NORMALIZER_KINDS:
            raise ValueError(
                f"aggregation mode {self.name!r}: normalizer must be one of {NORMALIZER_KINDS}, got {self.normalizer!r}"
            )
        if not callable(self.sequence_factor):
            raise ValueError(f"aggregation mode {self.name!r}: sequence_factor {self.sequence_factor!r} is not callable")

    def check_seq_norm_len(self, seq_norm_len: float | None) -> None:
        """Raise naming the mode when it needs a positive seq_norm_len and did not get one."""
        if self.needs_seq_norm_len and (seq_norm_len is None or seq_norm_len <= 0):
            raise ValueError(f"loss_agg_mode {self.name!r} needs a positive seq_norm_len, got {seq_norm_len!r}")

    def factors(self, token_counts: torch.Tensor, seq_norm_len: float | None = None) -> torch.Tensor:
        """f(n_i, L_norm) per sequence [S] float64; exactly 0 where n_i == 0."""
        self.check_seq_norm_len(seq_norm_len)
        n_i = torch.as_tensor(token_counts, dtype=torch.float64).reshape(-1)
        if n_i.numel() == 0:
            return n_i
        factor = torch.as_tensor(self.sequence_factor(n_i.clamp(min=1.0), seq_norm_len), dtype=torch.float64)
        factor = factor.expand_as(n_i) if factor.dim() == 0 else factor
        if factor.shape != n_i.shape:
            raise ValueError(
                f"aggregation mode {self.name!r}: sequence_factor returned shape {tuple(factor.shape)} for "
                f"{n_i.numel()} sequences"
            )
        return torch.where(n_i > 0, factor, torch.zeros_like(n_i))

    def global_count(self, num_tokens: float, num_sequences: float) -> float:
        """N of the step: num_tokens for `tokens` modes, num_sequences for `samples` modes."""
        return float(num_tokens if self.normalizer == TOKENS else num_sequences)

    def sequence_weight(self, token_counts: torch.Tensor, num_tokens: float, num_sequences: float,
                        seq_norm_len: float | None = None) -> torch.Tensor:
        """w_i = f(n_i, L_norm) / N per sequence [S] float64 (0 for n_i == 0 or an empty step)."""
        factors = self.factors(token_counts, seq_norm_len)
        count = self.global_count(num_tokens, num_sequences)
        return factors / count if count > 0 else torch.zeros_like(factors)


def _unit_factor(n_i, _norm_len):
    return torch.ones_like(n_i)


def _inverse_token_count(n_i, _norm_len):
    return 1.0 / n_i


def _inverse_norm_length(n_i, norm_len):
    return torch.full_like(n_i, 1.0 / norm_len)


def register_aggregation_mode(mode: AggregationMode, *, aliases: Sequence[str] = ()) -> AggregationMode:
    """Add `mode` to the AGGREGATIONS registry (raises on a duplicate name); returns it."""
    if not isinstance(mode, AggregationMode):
        raise ValueError(f"register_aggregation_mode expects an AggregationMode, got {type(mode).__name__}")
    for name in (mode.name, *aliases):
        # Checked here because the registry's own duplicate message expects a function.
        if name in AGGREGATIONS:
            raise ValueError(f"aggregation mode {name!r} is already registered; registered modes: {AGGREGATIONS.names()}")
    return AGGREGATIONS.register(mode.name, aliases=aliases)(mode)


BUILTIN_AGGREGATION_MODES = (
    AggregationMode("token-mean", TOKENS, _unit_factor, needs_whole_sequence_token_counts=False),
    AggregationMode("seq-mean-token-mean", SAMPLES, _inverse_token_count),
    AggregationMode("seq-mean-token-sum", SAMPLES, _unit_factor),
    AggregationMode("seq-mean-token-sum-norm", SAMPLES, _inverse_norm_length, needs_seq_norm_len=True),
)
BUILTIN_AGGREGATION_MODE_NAMES = tuple(mode.name for mode in BUILTIN_AGGREGATION_MODES)
for _mode in BUILTIN_AGGREGATION_MODES:
    register_aggregation_mode(_mode)


def get_aggregation_mode(mode: str) -> AggregationMode:
    """The `AggregationMode` for a name (built in or registered); unknown names list the known ones."""
    try:
        return AGGREGATIONS.get(mode)
    except ValueError:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known modes: {AGGREGATIONS.names()}") from None


def normalizer_kind(mode: str) -> str:
    """What the global count of `mode` counts: `"tokens"` or `"samples"`."""
    return get_aggregation_mode(mode).normalizer


def count_normalizer(loss_masks: Sequence[torch.Tensor], mode: str) -> torch.Tensor:
    """This micro-batch's share of the global count (float64 scalar); sum it over all ranks.

    tokens: sum_i n_i; samples: #{i : n_i > 0}, with n_i = `loss_token_count(m_i)`.
    """
    check_trajectory_lists("loss_masks", loss_masks)
    kind = normalizer_kind(mode)
    if not loss_masks:
        return torch.zeros((), dtype=torch.float64)
    per_trajectory = loss_token_counts(loss_masks).to(torch.float64)
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
    spec.check_seq_norm_len(seq_norm_len)
    if not per_token_losses:
        return torch.zeros(())
    factors = spec.factors(loss_token_counts(loss_masks), seq_norm_len)
    parts = [(loss * mask.to(loss.dtype)).sum() * factor.to(loss.dtype)
             for loss, mask, factor in zip(per_token_losses, loss_masks, factors)]
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


def sum_of_sample_mean(
    per_token: torch.Tensor,
    response_lengths: Sequence[int],
    loss_masks: Sequence[torch.Tensor],
) -> torch.Tensor:
    """S = sum_i (sum_t m_it x_it) / max(n_i, 1): the SUM over samples of each sample's masked mean.

    per_token: [N_response], the samples' whole responses concatenated (R_i tokens each, sum R_i
    = N_response), e.g. from `Specialization.response_log_probs`. response_lengths: R_i.
    loss_masks: one [R_i] mask per sample; n_i = its non-zero entries (`loss_token_count`).
    Returns a scalar. It is not divided by the number of samples: the step's reducer does that
    with the GLOBAL sample count (`reducer(S)`), so the result does not depend on the split.
    """
    lengths = [int(n) for n in response_lengths]
    if per_token.dim() != 1 or per_token.shape[0] != sum(lengths):
        raise ValueError(
            f"sum_of_sample_mean: per_token must be [N_response = sum(response_lengths) = {sum(lengths)}], "
            f"got {tuple(per_token.shape)}"
        )
    if len(loss_masks) != len(lengths):
        raise ValueError(f"sum_of_sample_mean: {len(loss_masks)} loss masks for {len(lengths)} samples")
    total = per_token.new_zeros(())
    for index, (values, mask) in enumerate(zip(per_token.split(lengths), loss_masks)):
        mask = torch.as_tensor(mask).to(device=values.device, dtype=values.dtype)
        if mask.shape != values.shape:
            raise ValueError(
                f"sum_of_sample_mean: loss_masks[{index}] has shape {tuple(mask.shape)}, expected ({lengths[index]},)"
            )
        total = total + (values * mask).sum() / loss_token_count(mask).clamp(min=1).to(values.dtype)
    return total
