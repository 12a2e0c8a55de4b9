"""The template every specialization follows, and the helpers they share.

A role worker calls `compute_loss` once per packed micro-batch, after the forward pass:

    micro_batch = MicroBatch.pack(sequences, response_lengths, groups=groups, loss_masks=..., ...)
    logits = forward_packed(model, *micro_batch.model_inputs(), groups)        # [T_local, V_pad/tp]
    loss, metric_sums = specialization.compute_loss(logits, micro_batch, reducer)
    loss.backward()
    metric_sums = all_reduce_metric_sums(metric_sums, groups.dp_cp)           # ONE all-reduce
    ...
    logged = specialization.metric_means(totals)                              # after the last micro-batch

`compute_loss` is a template method. The base class owns every step but the loss terms:

    check_reducer(reducer); check_batch(batch)          # mode, field presence and sizes (+ check_fields hook)
    view = response view of local_values(model_output)  # this rank's part of each response, or whole
                                                        # responses when needs_whole_sequences() (one CP all-gather)
    terms = per_token_terms(view, batch)                # THE SUBCLASS: per-token losses and metric sums
    loss = reducer(terms.per_token, masks, sequence_token_counts=n_i, replicated_across_cp=view.replicated)
    metrics = terms.metrics (reported once over CP) + num_loss_tokens + num_sequences

so a subclass writes `per_token_terms` (usually one kernel call) and, when it needs more than the
log-probs of the sampled tokens, `local_values`. Arguments of `compute_loss`:

- `model_output`: the TP-local logits shard [T_local, V_pad/tp] of this CP rank's slice of the
  packed micro-batch (values [T_local] for a critic, `outputs_values = True`), or, when the
  specialization does not need the logits, the LM head's inputs (`LMHeadShard`, below).
- `batch`: a `MicroBatch` (stacx.specializations.batch): `layout` (the `PackedLayout`), `tokens`
  (the WHOLE packed micro-batch), `response_lengths`, and the per-sample fields of `SampleFields`
  (one documented attribute each: `loss_masks`, `advantages`, `log_probs`, `ref_log_probs`, ...),
  whole responses aligned to prediction positions; the view cuts them like the model's values.
- `reducer`: the step's `stacx.parallel.reduction.Reducer`, built by the worker with
  `mode = specialization.loss_agg_mode()` and StepCounts from the full `loss_masks`.

What the trainer loop needs besides the loss (all on this class): `required_fields()`,
`needs_reference()` (fill `ref_log_probs` first), `needs_old_log_probs()` (fill `log_probs`, pi_old,
first), `receives_logits()` (logits or the LM head's inputs, below), `loss_agg_mode()`,
`compute_log_probs(model_output, batch)` (whole-response log-probs, no grad) and `metric_means(totals)`.

Logits or the LM head's inputs (`needs_logits`). The run setting `--lm-head-log-probs` lets the
worker skip the output layer's matmul and pass a `stacx.parallel.lm_head.LMHeadShard` (final
hidden states [T_local, H], output-weight shard [V_pad/tp, H], real vocab size, TP rank) instead
of the logits; `token_log_probs` then runs the fused kernel, which never builds the
[T_local, V_pad/tp] logits (same values and gradients). A specialization that reads only
`token_log_probs` (or `response_log_probs`, or the view's default values) works unchanged with
either. The contract:

- `needs_logits()` False: `model_output` may be an `LMHeadShard`; read it only through
  `token_log_probs` / `response_log_probs` (or `model_output.logits()`, which materializes them).
- `needs_logits()` True: `model_output` is always the logits tensor.
- A subclass that overrides `compute_loss`, `local_values` or `compute_log_probs` may read the
  logits itself, so it gets them (`receives_logits()`) unless that same class, or one below it,
  declares `needs_logits() -> False`.

A specialization composes stateless kernels (stacx.objectives) with the vocab-parallel and CP
utilities (stacx.parallel). It issues no collective of its own: the only communication is inside
`vocab_parallel_*` or the fused LM-head kernel (TP) and at most one `PackedLayout.gather_responses` (CP) per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from stacx.objectives.aggregation import loss_token_counts
from stacx.objectives.algorithm_config import ALGORITHM_DEFAULTS, AlgorithmConfig, as_algorithm_config
from stacx.parallel.cp_fields import PackedLayout, next_token_targets
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.lm_head import LMHeadShard
from stacx.parallel.reduction import Reducer
from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy
from stacx.specializations.batch import PER_RESPONSE_FIELDS, PER_SEQUENCE_FIELDS, MicroBatch

#: Count metrics every specialization reports; logged as totals, and the denominators of the others.
NUM_LOSS_TOKENS = "num_loss_tokens"
PLUGIN_METRIC_SUFFIX = "_plugin"
"""A specialization's metric named like a step metric the framework logs (`loss`, `grad_norm`, ...) is logged as
`<name>_plugin` (stacx.trainer.runtime.role_runtime.set_aside_step_metric_names); its declared denominator holds."""
NUM_SEQUENCES = "num_sequences"


#: Methods that receive `model_output`: a subclass that overrides one may read the logits itself.
LOGIT_READERS = ("compute_loss", "local_values", "compute_log_probs")


_DECLARED = object()
"""`Specialization.setting`'s marker for "no custom default given"."""


@dataclass
class LossTerms:
    """What a subclass's `per_token_terms` returns: per-token losses and metric sums of one micro-batch."""

    per_token: list[torch.Tensor]
    """One tensor per sequence, shaped like the view's values (this rank's part, or whole responses)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Metric sums (divided in `metric_means` by their count, num_loss_tokens unless declared)."""
    masks: list[torch.Tensor] | None = None
    """Masks to reduce with; None: the view's loss masks (an off-policy correction may drop tokens)."""
    sequence_token_counts: list[int] | None = None
    """n_i for the reducer; None: loss tokens of each whole response (one entry per loss per sequence: [1]*S)."""


class Specialization:
    """Base class: per-algorithm loss assembly for one role (see the module docstring)."""

    #: Whether the role's model outputs a value per token (critic) instead of logits.
    outputs_values: bool = False
    #: Whether the loss reads (chosen, rejected) preference pairs (`pair_ids`, `is_chosen`): the DPO
    #: settings of the run config apply to the recipe (`stacx train --dry-run` shows them).
    reads_preference_pairs: bool = False
    #: Per-response batch fields compute_loss needs besides `loss_masks`, which every batch carries.
    base_required_fields: tuple[str, ...] = ()
    #: Metric name -> name of the count metric it is divided by in `metric_means`
    #: (default NUM_LOSS_TOKENS; names starting with "num_" are counts, logged as totals).
    metric_denominators: Mapping[str, str] = {}

    @classmethod
    def policy_loss_in_use(cls) -> bool:
        """Whether this class's loss is the registered `policy_loss` (recipe summaries name it only then)."""
        return False

    @classmethod
    def reads_advantages(cls) -> bool:
        """Whether this class's loss reads the advantage estimator's output."""
        return "advantages" in cls.base_required_fields

    def __init__(self, config: AlgorithmConfig | None = None, groups: ProcessGroups | None = None):
        """config: the run's algorithm section (None: the declared defaults; any other type than
        `AlgorithmConfig` is refused here, before a kernel reads it). groups: this rank's ProcessGroups
        (None: one process)."""
        self.config: AlgorithmConfig = as_algorithm_config(config, f"{type(self).__name__}(config)")
        self.groups = groups if groups is not None else ProcessGroups.single_process()

    # ---- what the trainer loop asks ------------------------------------------------------------

    def required_fields(self) -> tuple[str, ...]:
        """Batch fields compute_loss reads, besides `layout`, `tokens` and `loss_masks`."""
        return self.base_required_fields

    def needs_reference(self) -> bool:
        """Whether `ref_log_probs` must be computed (in-worker reference, no-grad) before training."""
        return False

    def needs_old_log_probs(self) -> bool:
        """Whether `log_probs` (pi_old) must be computed (current weights, no-grad) before the first update."""
        return False

    def needs_whole_sequences(self) -> bool:
        """Whether `per_token_terms` needs whole responses on every CP rank (one all-gather when cp > 1)
        instead of this rank's part of each response."""
        return False

    def needs_logits(self) -> bool:
        """Whether `model_output` must be the logits shard rather than an `LMHeadShard` (the contract in
        the module docstring). Default: True when this class overrides one of `LOGIT_READERS` (it may
        read the logits), False otherwise (the template reads only `token_log_probs`). A class that
        reads the logits only through `token_log_probs` overrides this to return False."""
        return self.outputs_values or _overrides_below(type(self), Specialization, LOGIT_READERS)

    def receives_logits(self) -> bool:
        """What the worker asks before each forward (not meant to be overridden): `needs_logits()`, but
        True whenever a class below the one that declared `needs_logits` overrides a logit reader (a
        user subclass of `ActorSpecialization` with its own `local_values` gets logits)."""
        declared_in = _defining_class(type(self), "needs_logits")
        return self.needs_logits() or _overrides_below(type(self), declared_in, LOGIT_READERS)

    def loss_agg_mode(self) -> str:
        """The aggregation mode the step's Reducer must use (config `loss_agg_mode`, default token-mean)."""
        return self.config.loss_agg_mode

    @property
    def temperature(self) -> float:
        """Temperature of the log-probs (1.0: the model's own distribution)."""
        return 1.0

    # ---- the template --------------------------------------------------------------------------

    def compute_loss(self, model_output: torch.Tensor, batch: MicroBatch,
                     reducer: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to call backward on, metric sums to all-reduce once over DP x CP); see the module doc."""
        self.check_reducer(reducer)
        self.check_batch(batch)
        view = self.response_view(batch.layout, self.local_values(model_output, batch),
                                  whole=self.needs_whole_sequences(), loss_masks=batch.loss_masks)
        terms = self.per_token_terms(view, batch)
        loss = reducer(
            terms.per_token, view.loss_masks if terms.masks is None else terms.masks,
            sequence_token_counts=(batch.sequence_token_counts() if terms.sequence_token_counts is None
                                   else terms.sequence_token_counts),
            replicated_across_cp=view.replicated,
        )
        metrics = view.own_metrics(terms.metrics)
        metrics.update(view.count_metrics(view.loss_masks, batch.loss_masks))
        return loss, metrics

    def local_values(self, model_output: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """What the view cuts into responses, at every local position [T_local, ...]: by default the
        log-prob of each next token (vocab-parallel, with gradient, at `self.temperature`)."""
        log_probs_local, _ = self.token_log_probs(model_output, batch)
        return log_probs_local

    def check_fields(self, batch: MicroBatch) -> None:
        """Checks of field values beyond presence and size (e.g. teacher log-probs <= 0); default none."""

    def per_token_terms(self, view: "ResponseView", batch: MicroBatch) -> LossTerms:
        """Per-token losses and metric sums from the view's values (`view.values`, one tensor per
        sequence), its loss masks (`view.loss_masks`) and batch fields cut alike (`view.cut(...)`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement per_token_terms (or compute_loss)")

    # ---- forward-only and logging --------------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, model_output: torch.Tensor, batch: MicroBatch) -> list[torch.Tensor]:
        """Log-probs of each WHOLE response [R_i] (fp32, no grad) at `self.temperature`.

        Used for old and reference log-probs. With cp > 1 the responses are gathered (one
        all-gather), so every CP rank returns every sequence's full response.
        """
        if self.outputs_values:
            raise TypeError(f"{type(self).__name__} outputs values, not logits; use compute_values")
        log_probs_local, _ = self.token_log_probs(model_output, batch)
        return self.whole_responses(log_probs_local, batch.layout)

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
            declared_as = name.removesuffix(PLUGIN_METRIC_SUFFIX) if name not in self.metric_denominators else name
            denominator = totals.get(self.metric_denominators.get(declared_as, NUM_LOSS_TOKENS), 0.0)
            means[name] = value / denominator if denominator else 0.0
        return means

    # ---- shared helpers -----------------------------------------------------------------------

    def setting(self, name: str, custom_default: Any = _DECLARED) -> Any:
        """`config.<name>` for a knob named by a string. A knob declared in `AlgorithmConfig` is read as
        `self.config.<name>` (its one default is the field's) and refuses a second default here; a custom
        hyperparameter (`rwr_temperature`, set under `algorithm:`) needs `custom_default`, which the
        plugin that invents the knob declares."""
        if name in ALGORITHM_DEFAULTS:
            if custom_default is not _DECLARED:
                raise TypeError(f"{type(self).__name__}.setting({name!r}, ...): {name!r} is declared in AlgorithmConfig "
                                f"(default {ALGORITHM_DEFAULTS[name]!r}); read it as self.config.{name}")
            return getattr(self.config, name)
        if custom_default is _DECLARED:
            raise TypeError(f"{type(self).__name__}.setting({name!r}): {name!r} is a custom hyperparameter (not in "
                            f"AlgorithmConfig); give its default: self.setting({name!r}, DEFAULT)")
        value = self.config.extras.get(name)
        return custom_default if value is None else value

    def check_reducer(self, reducer: Reducer) -> None:
        """A reducer built with another aggregation mode would silently change the loss: refuse it."""
        if not isinstance(reducer, Reducer):
            raise TypeError(f"{type(self).__name__}.compute_loss needs a stacx.parallel.reduction.Reducer "
                            f"(Reducer.for_step(mode=specialization.loss_agg_mode(), ...)), got {type(reducer).__name__}")
        if reducer.mode != self.loss_agg_mode():
            raise ValueError(
                f"{type(self).__name__} needs a Reducer with mode {self.loss_agg_mode()!r} "
                f"(specialization.loss_agg_mode()), got {reducer.mode!r}"
            )

    def check_batch(self, batch: MicroBatch, names: Sequence[str] | None = None) -> PackedLayout:
        """Check that the batch was built for this CP rank, that the required fields (or `names`) are
        present and that every per-response field it carries is sized like the responses, then
        `check_fields`; returns the layout. Errors name the field and the sample."""
        if not isinstance(batch, MicroBatch):
            raise TypeError(f"{type(self).__name__}.compute_loss takes a MicroBatch (MicroBatch.pack(sequences, "
                            f"response_lengths, loss_masks=...)), got {type(batch).__name__}")
        layout = batch.layout
        if layout.cp_size != self.groups.cp_size or layout.cp_rank != self.groups.cp_rank:
            raise ValueError(
                f"batch field 'layout' was built for cp_rank {layout.cp_rank} of {layout.cp_size}, "
                f"this rank is cp_rank {self.groups.cp_rank} of {self.groups.cp_size}"
            )
        required = self.required_fields() if names is None else tuple(names)
        for name in dict.fromkeys(("loss_masks", *required, *(n for n in PER_RESPONSE_FIELDS if n in batch))):
            check_response_field(batch, name, layout)
        for name in PER_SEQUENCE_FIELDS:
            if name in batch and len(batch[name]) != len(layout.lengths):
                raise ValueError(f"batch field {name!r} has {len(batch[name])} entries, the micro-batch has "
                                 f"{len(layout.lengths)} sequences")
        self.check_fields(batch)
        return layout

    def token_log_probs(
        self, model_output: torch.Tensor | LMHeadShard, batch: MicroBatch, *, with_entropy: bool = False,
        entropy_requires_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(next token) at every local position [T_local] (and entropy [T_local] if asked).

        model_output: the logits shard [T_local, V/tp] (vocab-parallel kernel; the logits are not
        modified) or an `LMHeadShard` (fused kernel from the hidden states and the weight shard,
        same values and gradients, no logits built). One TP all-gather either way.
        """
        layout = batch.layout
        fused = isinstance(model_output, LMHeadShard)
        rows = model_output.num_tokens if fused else (model_output.shape[0] if model_output.dim() == 2 else None)
        if rows != layout.num_local_tokens:
            raise ValueError(
                f"model_output must be the TP-local logits [T_local={layout.num_local_tokens}, V/tp] (or an "
                f"LMHeadShard of as many tokens), got {f'{rows} tokens' if fused else tuple(model_output.shape)}"
            )
        targets_local = layout.slice_tokens(next_token_targets(batch.tokens, layout.lengths)).to(model_output.device)
        options = dict(tp_group=self.groups.tp, temperature=self.temperature, with_entropy=with_entropy,
                       entropy_requires_grad=entropy_requires_grad)
        if fused:
            return model_output.log_probs_and_entropy(targets_local, **options)
        return vocab_parallel_log_probs_and_entropy(model_output, targets_local, **options)

    def response_log_probs(self, model_output: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """log pi(y_t | y_<t, x) of every response token, whole responses concatenated: [N_response].

        N_response = sum(batch.response_lengths); sample i's tokens are the i-th R_i entries,
        aligned with `batch.loss_masks[i]`. Vocab-parallel over TP (one all-gather inside the
        kernel) and CP-gathered (one differentiable all-gather when cp > 1), with gradient, at
        `self.temperature`. So a subclass never touches TP or CP: every CP rank holds the same
        whole responses, and `reducer(sum_of_sample_mean(...))` counts them once (a scalar given to
        the reducer is taken as computed from such replicated whole responses).
        """
        if self.outputs_values:
            raise TypeError(f"{type(self).__name__} outputs values, not logits")
        log_probs_local, _ = self.token_log_probs(model_output, batch)
        responses = self.whole_responses(log_probs_local, batch.layout)
        return torch.cat(responses) if responses else log_probs_local.new_zeros((0,))

    def compute_values(self, model_output: torch.Tensor, batch) -> list[torch.Tensor]:
        """Values of each WHOLE response of a value-head role (`outputs_values`), for the `values`
        field: the model output at local positions, gathered per response. A critic reads its head."""
        return self.whole_responses(model_output, batch.layout)

    def whole_responses(self, local_values: torch.Tensor, layout: PackedLayout) -> list[torch.Tensor]:
        """Values at local positions [T_local, ...] -> each whole response (one all-gather when cp > 1)."""
        if self.groups.cp_size == 1:
            return layout.split_local_responses(local_values)
        return layout.gather_responses(local_values, self.groups.cp)

    def response_view(self, layout: PackedLayout, local_values: torch.Tensor, *, whole: bool,
                      loss_masks: Sequence[torch.Tensor] | None = None) -> "ResponseView":
        """Per-response values plus the matching cut of the batch fields (and of `loss_masks`, float32).

        whole=False: this rank's part of each response (no communication); whole=True: whole
        responses on every CP rank (one all-gather when cp > 1), to be reduced with
        `replicated_across_cp=True`.
        """
        replicated = whole and self.groups.cp_size > 1
        values = self.whole_responses(local_values, layout) if replicated else layout.split_local_responses(local_values)
        view = ResponseView(layout=layout, values=values, replicated=replicated, cp_rank=self.groups.cp_rank)
        if loss_masks is not None:
            view.loss_masks = view.cut(loss_masks)
        return view


@dataclass
class ResponseView:
    """Per-response model values on this rank and the batch fields cut the same way."""

    layout: PackedLayout
    values: list[torch.Tensor]
    """One tensor per sequence: this rank's response part, or the whole response when `replicated`."""
    replicated: bool
    """Whole responses gathered on every CP rank (reduce with replicated_across_cp=True)."""
    cp_rank: int
    loss_masks: list[torch.Tensor] | None = None
    """The batch's loss masks cut like `values`, float32 (set by `Specialization.compute_loss`)."""

    def cut(self, whole: Sequence[torch.Tensor], *, dtype: torch.dtype | None = torch.float32) -> list[torch.Tensor]:
        """A per-response field (one whole-response tensor per sequence) cut like `values`, on their
        device, as `dtype` (None: kept)."""
        full = [torch.as_tensor(t) for t in whole]
        parts = full if self.replicated else self.layout.slice_responses(full)
        device = self.values[0].device if self.values else None
        return [p.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else p for p in parts]

    def field(self, batch: MicroBatch, name: str, *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """`cut(batch[name])` (the field named by a string, as the first API did)."""
        return self.cut(batch[name], dtype=dtype)

    def own_metrics(self, metrics: Mapping[str, torch.Tensor | float]) -> dict[str, torch.Tensor | float]:
        """Metric sums this rank reports: with replicated whole responses only CP rank 0 reports
        (every CP rank holds the same values), so the DP x CP all-reduce counts them once."""
        if not self.replicated or self.cp_rank == 0:
            return dict(metrics)
        return {name: torch.zeros_like(v) if torch.is_tensor(v) else 0.0 for name, v in metrics.items()}

    def count_metrics(self, masks: Sequence[torch.Tensor], full_masks: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`num_loss_tokens` (mask entries != 0 of `masks`, counted once over CP) and
        `num_sequences` (sequences with a loss token, reported by CP rank 0 only)."""
        tokens = loss_token_counts(masks).sum().to(torch.float64)
        counts = self.own_metrics({NUM_LOSS_TOKENS: tokens})
        num_sequences = int((loss_token_counts(full_masks) > 0).sum()) if self.cp_rank == 0 else 0
        counts[NUM_SEQUENCES] = torch.tensor(float(num_sequences), dtype=torch.float64)
        return counts


def _defining_class(cls: type, name: str) -> type:
    """The class of `cls`'s MRO whose own body defines `name`."""
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def _overrides_below(cls: type, ancestor: type, names: Sequence[str]) -> bool:
    """Whether a class that comes before `ancestor` in `cls`'s MRO (a subclass or a mixin of one) defines
    one of `names`."""
    mro = cls.__mro__
    return any(mro.index(_defining_class(cls, name)) < mro.index(ancestor) for name in names)


def check_response_field(batch: MicroBatch, name: str, layout: PackedLayout) -> None:
    """`batch[name]` is a list of one tensor per sequence whose first dim is the response length."""
    values = batch.get(name)
    if values is None:
        raise ValueError(f"batch field {name!r} is missing (needed by this specialization)")
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
    """n_i of each WHOLE response as ints (`MicroBatch.sequence_token_counts`, for code written to the first API)."""
    return [int(n) for n in loss_token_counts(loss_masks)]


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
    "LOGIT_READERS",
    "LossTerms",
    "ResponseView",
    "Specialization",
    "check_response_field",
    "full_token_counts",
    "masked_total",
]
