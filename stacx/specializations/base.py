"""The interface every specialization implements, and the helpers they share.

A role worker calls `compute_loss` once per packed micro-batch, after the forward pass:

    batch = pack_micro_batch(sequences, response_lengths, groups=groups, loss_masks=..., ...)
    logits = forward_packed(model, *model_inputs(batch), groups)           # [T_local, V_pad/tp]
    loss, metric_sums = specialization.compute_loss(logits, batch, reducer)
    loss.backward()
    totals.add(all_reduce_metric_sums(metric_sums, groups.dp_cp))          # ONE all-reduce
    ...
    logged = specialization.metric_means(totals.sums)                       # after the last micro-batch

Arguments of `compute_loss`:

- `model_output`: the TP-local logits shard [T_local, V_pad/tp] of this CP rank's slice of the
  packed micro-batch (values [T_local] for a critic, `outputs_values = True`).
- `batch`: a dict (see `stacx.specializations.batch.pack_micro_batch`):
    * `layout`: the `PackedLayout` of the micro-batch for this CP rank (lengths, prompt lengths,
      CP slicing);
    * `response_lengths`: R_i of each sequence (ints, whole responses);
    * `tokens`: the WHOLE packed micro-batch [sum(lengths)] int64, identical on every CP rank
      (the model input is `layout.slice_tokens(tokens)`; the full row is kept because the
      target of a chunk's last token lives in another chunk);
    * per-response fields: lists with one tensor per sequence holding the WHOLE response, never
      CP-sliced, [R_i] or [R_i, K], aligned to prediction positions (token j of response i is
      predicted at sequence position prompt_length_i - 1 + j). Specializations slice them with
      the layout, which also lets them check lengths and name the field and sample at fault.
      Names: `loss_masks`, `rollout_log_probs`, `old_log_probs`, `ref_log_probs`, `advantages`,
      `values`, `returns`, `teacher_log_probs`, `teacher_top_ids`, `teacher_top_log_probs`;
    * per-sequence fields: lists/1-D tensors of length S (DPO's `pair_ids`, `is_chosen`).
- `reducer`: `stacx.parallel.reduction.Reducer` for the step, built by the worker with
  `mode = specialization.loss_agg_mode()` and StepCounts from the full `loss_masks`.

What the trainer loop needs besides the loss (all on this class):

- `required_fields()`: batch fields `compute_loss` needs (besides `layout` and `tokens`).
- `needs_reference()`: True when `ref_log_probs` must be filled before training, by a no-grad
  forward of the frozen reference held in the same worker, through `compute_log_probs`.
- `needs_old_log_probs()`: True when `old_log_probs` must be filled by a no-grad forward of the
  current weights before the first update (needed only when one rollout feeds several
  optimizer steps; otherwise the current forward's detached log-probs ARE pi_old).
- `loss_agg_mode()`: the mode the step's Reducer must be built with.
- `compute_log_probs(model_output, batch)`: whole-response log-probs per sequence, no grad
  (one CP all-gather when cp > 1), for old/reference log-probs.
- `metric_means(totals)`: reduced metric sums of a step -> logged means.

A specialization composes stateless kernels (stacx.objectives) with the vocab-parallel and CP
utilities (stacx.parallel). It issues no collective of its own: the only communication is inside
`vocab_parallel_*` (TP) and at most one `PackedLayout.gather_responses` (CP) per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from stacx.objectives.algorithm_config import ALGORITHM_DEFAULTS
from stacx.objectives.validation import hyperparameter
from stacx.parallel.cp_fields import PackedLayout, next_token_targets
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy

#: Count metrics every specialization reports; logged as totals, and the denominators of the others.
NUM_LOSS_TOKENS = "num_loss_tokens"
NUM_SEQUENCES = "num_sequences"


_DECLARED = object()
"""`Specialization.setting`'s marker for "no custom default given"."""


class Specialization:
    """Base class: per-algorithm loss assembly for one role (see the module docstring)."""

    #: Whether the role's model outputs a value per token (critic) instead of logits.
    outputs_values: bool = False
    #: Per-response batch fields compute_loss always needs (subclasses extend `required_fields`).
    base_required_fields: tuple[str, ...] = ("loss_masks",)
    #: Metric name -> name of the count metric it is divided by in `metric_means`
    #: (default NUM_LOSS_TOKENS; names starting with "num_" are counts, logged as totals).
    metric_denominators: Mapping[str, str] = {}

    def __init__(self, config: Any = None, groups: ProcessGroups | None = None):
        """config: the run's algorithm section (any object with attributes; missing ones take
        defaults, read like the loss kernels do). groups: this rank's ProcessGroups (None: one process)."""
        self.config = config
        self.groups = groups if groups is not None else ProcessGroups.single_process()

    # ---- what the trainer loop asks ------------------------------------------------------------

    def required_fields(self) -> tuple[str, ...]:
        """Batch fields compute_loss reads, besides `layout` and `tokens`."""
        return self.base_required_fields

    def needs_reference(self) -> bool:
        """Whether `ref_log_probs` must be computed (in-worker reference, no-grad) before training."""
        return False

    def needs_old_log_probs(self) -> bool:
        """Whether `old_log_probs` must be computed (current weights, no-grad) before the first update."""
        return False

    def loss_agg_mode(self) -> str:
        """The aggregation mode the step's Reducer must use (config `loss_agg_mode`, default token-mean)."""
        return str(self.setting("loss_agg_mode"))

    @property
    def temperature(self) -> float:
        """Temperature of the log-probs (1.0: the model's own distribution)."""
        return 1.0

    def compute_loss(
        self,
        model_output: torch.Tensor,
        batch: dict[str, Any],
        reducer: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to call backward on, metric sums to all-reduce once over DP x CP)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss")

    @torch.no_grad()
    def compute_log_probs(self, model_output: torch.Tensor, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Log-probs of each WHOLE response [R_i] (fp32, no grad) at `self.temperature`.

        Used for old and reference log-probs. With cp > 1 the responses are gathered (one
        all-gather), so every CP rank returns every sequence's full response.
        """
        if self.outputs_values:
            raise TypeError(f"{type(self).__name__} outputs values, not logits; use compute_values")
        log_probs_local, _ = self.token_log_probs(model_output, batch)
        return self.whole_responses(log_probs_local, batch["layout"])

    def metric_means(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Step metrics to log from reduced, micro-batch-accumulated sums.

        Counts ("num_*") are kept as totals; every other metric is divided by its count in
        `metric_denominators` (default num_loss_tokens), 0 when that count is 0.
        """
        means = {}
        for name, value in totals.items():
            if name.startswith("num_"):
                means[name] = value
                continue
            denominator = totals.get(self.metric_denominators.get(name, NUM_LOSS_TOKENS), 0.0)
            means[name] = value / denominator if denominator else 0.0
        return means

    # ---- shared helpers -----------------------------------------------------------------------

    def setting(self, name: str, custom_default: Any = _DECLARED) -> Any:
        """`config.<name>`. A knob declared in `AlgorithmConfig` takes its one default from there (see
        `hyperparameter`) and refuses a second one here; a custom hyperparameter (`rwr_temperature`, set
        under `algorithm:`) needs `custom_default`, which the plugin that invents the knob declares."""
        if name in ALGORITHM_DEFAULTS:
            if custom_default is not _DECLARED:
                raise TypeError(f"{type(self).__name__}.setting({name!r}, ...): {name!r} is declared in AlgorithmConfig "
                                f"(default {ALGORITHM_DEFAULTS[name]!r}); read it as self.setting({name!r})")
            return hyperparameter(self.config, name)
        if custom_default is _DECLARED:
            raise TypeError(f"{type(self).__name__}.setting({name!r}): {name!r} is a custom hyperparameter (not in "
                            f"AlgorithmConfig); give its default: self.setting({name!r}, DEFAULT)")
        value = getattr(self.config, name, None) if self.config is not None else None
        return custom_default if value is None else value

    def check_reducer(self, reducer) -> None:
        """A reducer built with another aggregation mode would silently change the loss: refuse it."""
        mode = getattr(reducer, "mode", None)
        if mode is not None and mode != self.loss_agg_mode():
            raise ValueError(
                f"{type(self).__name__} needs a Reducer with mode {self.loss_agg_mode()!r} "
                f"(specialization.loss_agg_mode()), got {mode!r}"
            )

    def check_batch(self, batch: Mapping[str, Any], names: Sequence[str] | None = None) -> PackedLayout:
        """Check that `layout`, `tokens` and the named per-response fields are present and sized
        like the responses; returns the layout. Errors name the field and the sample."""
        layout = batch.get("layout")
        if not isinstance(layout, PackedLayout):
            raise ValueError(f"batch field 'layout' must be a PackedLayout, got {type(layout).__name__}")
        if layout.cp_size != self.groups.cp_size or layout.cp_rank != self.groups.cp_rank:
            raise ValueError(
                f"batch field 'layout' was built for cp_rank {layout.cp_rank} of {layout.cp_size}, "
                f"this rank is cp_rank {self.groups.cp_rank} of {self.groups.cp_size}"
            )
        tokens = batch.get("tokens")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.shape[0] != sum(layout.lengths):
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(
                f"batch field 'tokens' must be the whole packed micro-batch [{sum(layout.lengths)}], got {shape}"
            )
        for name in self.required_fields() if names is None else names:
            check_response_field(batch, name, layout)
        return layout

    def token_log_probs(
        self, logits: torch.Tensor, batch: Mapping[str, Any], *, with_entropy: bool = False,
        entropy_requires_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(next token) at every local position [T_local] (and entropy [T_local] if asked).

        One TP all-gather (inside the vocab-parallel kernel). The logits are not modified.
        """
        layout = batch["layout"]
        if logits.dim() != 2 or logits.shape[0] != layout.num_local_tokens:
            raise ValueError(
                f"model_output must be the TP-local logits [T_local={layout.num_local_tokens}, V/tp], "
                f"got {tuple(logits.shape)}"
            )
        targets_local = layout.slice_tokens(next_token_targets(batch["tokens"], layout.lengths)).to(logits.device)
        return vocab_parallel_log_probs_and_entropy(
            logits, targets_local, tp_group=self.groups.tp, temperature=self.temperature,
            with_entropy=with_entropy, entropy_requires_grad=entropy_requires_grad,
        )

    def response_log_probs(self, model_output: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        """log pi(y_t | y_<t, x) of every response token, whole responses concatenated: [N_response].

        N_response = sum(batch["response_lengths"]); sample i's tokens are the i-th R_i entries,
        aligned with `batch["loss_masks"][i]`. Vocab-parallel over TP (one all-gather inside the
        kernel) and CP-gathered (one differentiable all-gather when cp > 1), with gradient, at
        `self.temperature`. So a subclass never touches TP or CP: every CP rank holds the same
        whole responses, and `reducer(sum_of_sample_mean(...))` counts them once (a scalar given to
        the reducer is taken as computed from such replicated whole responses).
        """
        if self.outputs_values:
            raise TypeError(f"{type(self).__name__} outputs values, not logits")
        log_probs_local, _ = self.token_log_probs(model_output, batch)
        responses = self.whole_responses(log_probs_local, batch["layout"])
        return torch.cat(responses) if responses else log_probs_local.new_zeros((0,))

    def whole_responses(self, local_values: torch.Tensor, layout: PackedLayout) -> list[torch.Tensor]:
        """Values at local positions [T_local, ...] -> each whole response (one all-gather when cp > 1)."""
        if self.groups.cp_size == 1:
            return layout.split_local_responses(local_values)
        return layout.gather_responses(local_values, self.groups.cp)

    def response_view(self, layout: PackedLayout, local_values: torch.Tensor, *, whole: bool) -> "ResponseView":
        """Per-response values plus the matching view of the batch fields.

        whole=False: this rank's part of each response (no communication); whole=True: whole
        responses on every CP rank (one all-gather when cp > 1), to be reduced with
        `replicated_across_cp=True`.
        """
        replicated = whole and self.groups.cp_size > 1
        values = self.whole_responses(local_values, layout) if replicated else layout.split_local_responses(local_values)
        return ResponseView(layout=layout, values=values, replicated=replicated, cp_rank=self.groups.cp_rank)


@dataclass
class ResponseView:
    """Per-response model values on this rank and the batch fields sliced the same way."""

    layout: PackedLayout
    values: list[torch.Tensor]
    """One tensor per sequence: this rank's response part, or the whole response when `replicated`."""
    replicated: bool
    """Whole responses gathered on every CP rank (reduce with replicated_across_cp=True)."""
    cp_rank: int

    def field(self, batch: Mapping[str, Any], name: str, *, device=None, dtype=None) -> list[torch.Tensor]:
        """A per-response batch field cut like `values` (whole responses are used as they are)."""
        full = [torch.as_tensor(t) for t in batch[name]]
        parts = full if self.replicated else self.layout.slice_responses(full)
        device = device if device is not None else (self.values[0].device if self.values else None)
        return [p.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else p for p in parts]

    def own_metrics(self, metrics: Mapping[str, torch.Tensor | float]) -> dict[str, torch.Tensor | float]:
        """Metric sums this rank reports: with replicated whole responses only CP rank 0 reports
        (every CP rank holds the same values), so the DP x CP all-reduce counts them once."""
        if not self.replicated or self.cp_rank == 0:
            return dict(metrics)
        return {name: torch.zeros_like(v) if torch.is_tensor(v) else 0.0 for name, v in metrics.items()}

    def count_metrics(self, masks: Sequence[torch.Tensor], full_masks: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`num_loss_tokens` (mask entries != 0 of `masks`, counted once over CP) and
        `num_sequences` (sequences with a loss token, reported by CP rank 0 only)."""
        tokens = torch.stack([(m != 0).sum().to(torch.float64) for m in masks]).sum() if masks else torch.zeros(())
        counts = self.own_metrics({NUM_LOSS_TOKENS: tokens.to(torch.float64)})
        num_sequences = sum(int(n > 0) for n in full_token_counts(full_masks)) if self.cp_rank == 0 else 0
        counts[NUM_SEQUENCES] = torch.tensor(float(num_sequences), dtype=torch.float64)
        return counts


def check_response_field(batch: Mapping[str, Any], name: str, layout: PackedLayout) -> None:
    """`batch[name]` is a list of one tensor per sequence whose first dim is the response length."""
    if name not in batch or batch[name] is None:
        raise ValueError(f"batch field {name!r} is missing (needed by this specialization)")
    values = batch[name]
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise ValueError(f"batch field {name!r} must be a list with one tensor per sample, got {type(values).__name__}")
    if len(values) != len(layout.response_lengths):
        raise ValueError(
            f"batch field {name!r} has {len(values)} samples, the micro-batch has {len(layout.response_lengths)}"
        )
    for index, (value, response_length) in enumerate(zip(values, layout.response_lengths)):
        length = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None
        if length != response_length:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"batch field {name!r}: sample {index} has shape {shape}, expected {response_length} entries "
                f"(one per response token)"
            )


def full_token_counts(loss_masks: Sequence[torch.Tensor]) -> list[int]:
    """n_i: loss tokens of each WHOLE response (the reducer's sequence_token_counts)."""
    return [int((torch.as_tensor(m) != 0).sum()) for m in loss_masks]


def masked_total(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_i sum_t m_it v_it, detached, float64 (a metric sum)."""
    parts = [
        (v.detach().to(torch.float64) * m.detach().to(device=v.device, dtype=torch.float64)).sum()
        for v, m in zip(values, masks)
    ]
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)


__all__ = [
    "NUM_LOSS_TOKENS",
    "NUM_SEQUENCES",
    "ResponseView",
    "Specialization",
    "check_response_field",
    "full_token_counts",
    "masked_total",
]
