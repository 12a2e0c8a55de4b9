"""The single reduction contract: every loss is a weighted SUM of per-token terms over the step.

For a step whose global batch (all DP ranks, all micro-batches) has sequences i with loss masks
m_it and per-token losses l_it, the loss whose gradient the optimizer sees is

    L = sum_i w_i sum_t m_it l_it

with per-sequence weights fixed by the aggregation mode and by GLOBAL counts known before the
first backward (N_tok: loss tokens in the step, N_seq: sequences with at least one loss token,
n_i: loss tokens of sequence i, counted over the whole sequence even when CP splits it). The
modes, their weights w_i = f(n_i, norm_length) / N and the token-count convention (n_i = number
of non-zero mask entries) are defined once, in `stacx.objectives.aggregation`; any mode
registered there (built in or custom) works here:

    token-mean               w_i = 1 / N_tok
    seq-mean-token-mean      w_i = 1 / (N_seq * n_i)
    seq-mean-token-sum       w_i = 1 / N_seq
    seq-mean-token-sum-norm  w_i = 1 / (N_seq * norm_length)     (norm_length: a constant, e.g. max response length)

Each rank sums only its own tokens (its DP samples, its CP chunks, one micro-batch at a time), so
L is the sum over ranks and micro-batches of the per-micro-batch partial sums: the split does not
enter. What remains is the gradient averaging of megatron-core DDP: with
`calculate_per_token_loss=False` it sums gradients over the DP x CP group and scales them by
1 / (dp * cp) (distributed_data_parallel.py: gradient_scaling_factor = 1 / dp_cp_group.size()).
The reducer multiplies each partial sum by `gradient_scale` = dp * cp (times the number of micro-
batches if the schedule also divides by it, as megatron's forward_backward_func does), so that
the averaged, accumulated gradient is exactly dL/dtheta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from stacx.objectives.aggregation import (
    BUILTIN_AGGREGATION_MODE_NAMES,
    AggregationMode,
    get_aggregation_mode,
    loss_token_counts,
)
from stacx.parallel.collectives import all_reduce_sum_
from stacx.parallel.groups import ProcessGroups

AGGREGATION_MODES = BUILTIN_AGGREGATION_MODE_NAMES
"""The built-in mode names; `Reducer` accepts any name registered in the AGGREGATIONS registry."""


@dataclass(frozen=True, kw_only=True)
class StepCounts:
    """Global counts of one optimizer step, identical on every rank."""

    num_tokens: int
    """Loss-mask tokens over the whole global batch (all DP ranks, all micro-batches)."""
    num_sequences: int
    """Sequences with at least one loss token over the whole global batch."""
    num_routed_tokens: int = 0
    """Token positions a mixture-of-experts router sees over the whole global batch (every packed position,
    padding included, counted once per sequence however CP splits it); 0 for a dense model."""


def count_loss_tokens(sample_loss_masks: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(loss tokens, sequences with >= 1 loss token) of full, unsliced per-sample masks.

    Tokens are counted by `loss_token_counts` (non-zero mask entries), the one Stacx convention.
    """
    counts = loss_token_counts(list(sample_loss_masks))
    return int(counts.sum()), int((counts > 0).sum())


def compute_step_counts(sample_loss_masks: Iterable[torch.Tensor], dp_group: dist.ProcessGroup | None) -> StepCounts:
    """Global StepCounts from this DP rank's full per-sample loss masks (all its micro-batches).

    Call once per step, before the first backward, with the DP group (NOT DP x CP: CP peers hold
    the same samples). One all-reduce of two numbers.
    """
    local = torch.tensor(count_loss_tokens(sample_loss_masks), dtype=torch.float64)
    total = all_reduce_sum_(local, dp_group)
    return StepCounts(num_tokens=int(total[0]), num_sequences=int(total[1]))


@dataclass(frozen=True, kw_only=True)
class Reducer:
    """Turns per-token losses of one micro-batch into the tensor to call backward on.

    Built once per step by the worker (`Reducer.for_step`) and handed to `compute_loss`.
    """

    mode: str
    """Aggregation mode: a name in the AGGREGATIONS registry (stacx.objectives.aggregation)."""
    counts: StepCounts
    """Global counts of the step (compute_step_counts)."""
    gradient_average_size: int
    """Ranks DDP averages gradients over: dp_size * cp_size."""
    cp_size: int = 1
    """Context-parallel size; sequences are split over this many ranks."""
    norm_length: float | None = None
    """Constant per-sequence divisor of seq-mean-token-sum-norm (e.g. the max response length)."""
    schedule_divisor: int = 1
    """Set to the number of micro-batches when the training schedule divides each loss by it."""
    aggregation: AggregationMode = field(init=False, repr=False, compare=False)
    """The registered definition of `mode` (looked up once)."""

    def __post_init__(self):
        aggregation = get_aggregation_mode(self.mode)
        if aggregation.needs_seq_norm_len and not (self.norm_length and self.norm_length > 0):
            raise ValueError(f"loss aggregation mode {self.mode!r} needs norm_length > 0, got {self.norm_length!r}")
        object.__setattr__(self, "aggregation", aggregation)
        for name in ("gradient_average_size", "cp_size", "schedule_divisor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_step(cls, *, mode: str, counts: StepCounts, groups: ProcessGroups, norm_length: float | None = None,
                 schedule_divisor: int = 1) -> "Reducer":
        """The reducer for one step on a rank with ProcessGroups `groups`."""
        return cls(mode=mode, counts=counts, gradient_average_size=groups.dp_cp_size, cp_size=groups.cp_size,
                   norm_length=norm_length, schedule_divisor=schedule_divisor)

    @property
    def gradient_scale(self) -> float:
        """Factor between the weighted partial sum and the returned loss (undoes DDP/schedule averaging)."""
        return float(self.gradient_average_size * self.schedule_divisor)

    def sequence_weights(self, sequence_token_counts: Sequence[int]) -> torch.Tensor:
        """w_i per sequence [S] float64 (0 for a sequence without loss tokens or an empty step)."""
        return self.aggregation.sequence_weight(
            torch.as_tensor(list(sequence_token_counts), dtype=torch.float64),
            num_tokens=self.counts.num_tokens, num_sequences=self.counts.num_sequences,
            seq_norm_len=self.norm_length,
        )

    def __call__(
        self,
        per_token_losses: Sequence[torch.Tensor] | torch.Tensor,
        loss_masks: Sequence[torch.Tensor] | None = None,
        *,
        sequence_token_counts: Sequence[int] | None = None,
        replicated_across_cp: bool | None = None,
    ) -> torch.Tensor:
        """gradient_scale * sum_i w_i sum_t m_it l_it over this rank's part of the micro-batch.

        per_token_losses / loss_masks: one tensor per sequence (this rank's tokens of it).
        sequence_token_counts: n_i, loss tokens of each WHOLE sequence; required for seq-mean modes
        when cp_size > 1 (the local masks only see part of each sequence).
        replicated_across_cp: the losses cover whole sequences gathered on every CP rank
        (PackedLayout.gather_responses); each CP replica then carries 1/cp of the sum.

        A scalar S instead (`reducer(sum_of_sample_mean(...))`, guide 003) is a sum over this
        rank's samples of per-sample means; the result is gradient_scale * S / N_seq (N_seq the
        GLOBAL sample count), divided by cp when S covers whole samples replicated on every CP
        rank (`replicated_across_cp`, default True for a scalar, as `response_log_probs` gives).
        """
        if isinstance(per_token_losses, torch.Tensor) and per_token_losses.dim() == 0:
            if loss_masks is not None or sequence_token_counts is not None:
                raise ValueError("reducer(scalar) takes no loss_masks or sequence_token_counts (the scalar is "
                                 "already a sum of per-sample means, see sum_of_sample_mean)")
            replicated = True if replicated_across_cp is None else replicated_across_cp
            scale = self.gradient_scale / (self.cp_size if replicated else 1)
            num_sequences = self.counts.num_sequences
            return per_token_losses * (scale / num_sequences if num_sequences else 0.0)
        if loss_masks is None:
            raise ValueError("reducer(per_token_losses, loss_masks): loss_masks is required for per-token losses")
        replicated_across_cp = bool(replicated_across_cp)
        if len(per_token_losses) != len(loss_masks):
            raise ValueError(f"{len(per_token_losses)} per-token loss tensors but {len(loss_masks)} loss masks")
        if sequence_token_counts is None:
            if self.aggregation.needs_whole_sequence_token_counts and self.cp_size > 1 and not replicated_across_cp:
                raise ValueError(
                    f"loss aggregation mode {self.mode!r} under cp_size={self.cp_size} needs sequence_token_counts "
                    "(loss tokens of each whole sequence)"
                )
            sequence_token_counts = loss_token_counts(loss_masks).tolist()
        if len(sequence_token_counts) != len(loss_masks):
            raise ValueError(f"{len(sequence_token_counts)} sequence_token_counts for {len(loss_masks)} sequences")
        if not per_token_losses:
            raise ValueError("no sequences to reduce")
        weights = self.sequence_weights(sequence_token_counts).tolist()
        scale = self.gradient_scale / (self.cp_size if replicated_across_cp else 1)
        total = None
        for loss, mask, weight in zip(per_token_losses, loss_masks, weights):
            if loss.shape != mask.shape:
                raise ValueError(f"per-token loss shape {tuple(loss.shape)} != loss mask shape {tuple(mask.shape)}")
            term = (loss * mask.to(loss.dtype)).sum() * (weight * scale)
            total = term if total is None else total + term
        return total

    def router_loss_scale(self, micro_batch_routed_tokens: int) -> float:
        """The gradient scale of a micro-batch's router losses (megatron's MoE aux and z losses).

        Each router loss is a mean over the micro-batch's n_mb routed tokens, so it enters L with weight
        n_mb / N_routed (N_routed = counts.num_routed_tokens): L_router = sum_mb n_mb / N_routed * r_mb,
        the token-weighted mean over the step, times gradient_scale like every partial sum here.
        """
        if self.counts.num_routed_tokens <= 0:
            raise ValueError("router_loss_scale needs StepCounts.num_routed_tokens > 0 (a mixture-of-experts step)")
        return micro_batch_routed_tokens / self.counts.num_routed_tokens * self.gradient_scale

    def loss_value(self, reduced_loss: torch.Tensor) -> float:
        """This micro-batch's contribution to L (for logging): the returned loss / gradient_scale."""
        return float(reduced_loss.detach()) / self.gradient_scale
