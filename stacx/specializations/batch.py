"""`MicroBatch`: what a specialization receives, and the per-sample fields it shares with the step batch.

    micro_batch = MicroBatch.pack([prompt_and_response_ids, ...], response_lengths, groups=groups,
                                  loss_masks=[...], rollout_log_probs=[...], advantages=[...])
    logits = forward_packed(model, *micro_batch.model_inputs(), groups)
    loss, metric_sums = specialization.compute_loss(logits, micro_batch, reducer)

`SampleFields` names every per-sample field once; `MicroBatch` (here) and the trainer's
`StepBatch` (stacx.trainer.batch, which the driver fills and plans into micro-batches) both carry
them. Per-response fields are whole responses (one tensor per sequence, [R_i] or [R_i, K]); the
specialization slices them for this CP rank. Pure index arithmetic, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional, Sequence

import torch

from stacx.objectives.aggregation import loss_token_counts
from stacx.parallel.cp_fields import PackedLayout
from stacx.parallel.groups import ProcessGroups

Tensors = Optional[list[torch.Tensor]]

#: Per-response fields: one whole-response tensor per sample, aligned to prediction positions.
PER_RESPONSE_FIELDS = (
    "loss_masks", "rollout_log_probs", "log_probs", "ref_log_probs", "advantages", "values", "returns",
    "teacher_log_probs", "teacher_top_ids", "teacher_top_log_probs", "executors",
)
#: Per-sequence fields: one value per sample.
PER_SEQUENCE_FIELDS = ("pair_ids", "is_chosen")
#: Per-token fields: one tensor per sample covering its prompt and response tokens (model inputs, not targets).
PER_TOKEN_FIELDS = ("routed_experts",)
#: Names the step batch dict used to carry, and the one field that holds each now.
RENAMED_FIELDS = {"old_log_probs": "log_probs", "group_indices": "prompt_id"}


@dataclass(kw_only=True)
class SampleFields:
    """The per-sample fields of a batch, one name each (None: the batch does not carry it)."""

    loss_masks: list[torch.Tensor]
    """[R_i] float: 1 where the response token is trained on (0: prompt-like, environment or padding)."""
    rollout_log_probs: Tensors = None
    """[R_i]: log-probs the rollout engine sampled with (off-policy corrections, mismatch metrics)."""
    log_probs: Tensors = None
    """[R_i]: pi_old, recomputed by the current weights before the first update (`recompute_old_log_probs`);
    absent: the training forward's detached log-probs are pi_old. The advantage estimators' `log_probs`."""
    ref_log_probs: Tensors = None
    """[R_i]: log-probs of the frozen reference (KL loss, DPO)."""
    advantages: Tensors = None
    """[R_i] float32: per-token advantages from the run's estimator."""
    values: Tensors = None
    """[R_i]: the critic's values at rollout time (V_old of the value clip; GAE)."""
    returns: Tensors = None
    """[R_i] float32: value targets of the critic."""
    teacher_log_probs: Tensors = None
    """[R_i]: the teacher's log-prob of each sampled token (+1.0 sentinel on teacher-executed tokens)."""
    teacher_top_ids: Tensors = None
    """[R_i, K] int64: the teacher's top-K token ids (distillation, topk mode)."""
    teacher_top_log_probs: Tensors = None
    """[R_i, K]: the teacher's log-probs at `teacher_top_ids`."""
    executors: Tensors = None
    """[R_i] int64: who produced each response token (student, teacher, environment; rollout.environments)."""
    pair_ids: Optional[list[int]] = None
    """DPO: the pair each sequence belongs to (both halves share a micro-batch)."""
    is_chosen: Optional[list[bool]] = None
    """DPO: whether the sequence is the chosen (True) or rejected half of its pair."""
    routed_experts: Tensors = None
    """[L_i - 1, MoE layers, top_k] int: the experts the rollout engine sent each token to (all but the
    last, which it never ran); set with --use-routing-replay, whose policy forwards replay them."""

    # ---- read access by name (for code that names fields in data: syncs, compute_fields) ------

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, self._field_name(name))
        if value is None:
            raise KeyError(f"batch field {name!r} is not set in this {type(self).__name__}")
        return value

    def get(self, name: str, default: Any = None) -> Any:
        """The field's value, or `default` when it is not set (a renamed field's old name is refused)."""
        if name not in RENAMED_FIELDS and name not in self.field_names():
            return default
        value = getattr(self, self._field_name(name))
        return default if value is None else value

    def __contains__(self, name: object) -> bool:
        if name in RENAMED_FIELDS:
            self._field_name(name)  # raises, naming the new name: a silent False would skip the field
        return isinstance(name, str) and name in self.field_names() and getattr(self, name) is not None

    def set_field(self, name: str, values: Any) -> None:
        """Set a field named in data (a sync's keys, a computed field); unknown names are refused."""
        setattr(self, self._field_name(name), values)

    def per_sample_fields(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every set per-response and per-sequence field."""
        for name in (*PER_RESPONSE_FIELDS, *PER_SEQUENCE_FIELDS, *PER_TOKEN_FIELDS):
            value = getattr(self, name)
            if value is not None:
                yield name, value

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def _field_name(self, name: str) -> str:
        if name in RENAMED_FIELDS:
            raise KeyError(f"batch field {name!r} is now {RENAMED_FIELDS[name]!r}; rename it in your code")
        if name not in self.field_names():
            raise KeyError(f"{type(self).__name__} has no field {name!r}; known: {list(self.field_names())}")
        return name


@dataclass(kw_only=True)
class MicroBatch(SampleFields):
    """One packed micro-batch on one rank: the layout, the packed tokens and the per-sample fields.

    Built by `MicroBatch.pack`; a specialization's `compute_loss` reads it.
    """

    layout: PackedLayout
    """Lengths, prompt lengths and CP slicing of the micro-batch for this CP rank."""
    tokens: torch.Tensor
    """[sum L_i] int64: the WHOLE packed micro-batch, identical on every CP rank (the model input is
    `layout.slice_tokens(tokens)`; the target of a chunk's last token lives in another chunk)."""
    response_lengths: list[int]
    """R_i of each sequence (whole responses)."""

    @classmethod
    def pack(cls, sequences: Sequence[torch.Tensor], response_lengths: Sequence[int], *,
             groups: ProcessGroups | None = None, **sample_fields: Any) -> "MicroBatch":
        """sequences: token ids of each sequence, prompt then response ([L_i] int). response_lengths: R_i
        per sequence (the prompt is the first L_i - R_i >= 1 tokens). sample_fields: `SampleFields`
        by name (`loss_masks`, `advantages`, `pair_ids`, ...), stored unchanged."""
        groups = groups if groups is not None else ProcessGroups.single_process()
        if len(sequences) != len(response_lengths):
            raise ValueError(f"{len(sequences)} sequences but {len(response_lengths)} response_lengths")
        if not sequences:
            raise ValueError("a micro-batch needs at least one sequence")
        lengths = [int(torch.as_tensor(s).shape[0]) for s in sequences]
        for index, (length, response) in enumerate(zip(lengths, response_lengths)):
            if not 1 <= int(response) <= length - 1:
                raise ValueError(
                    f"response_lengths[{index}]={response} must be in [1, {length - 1}] (sequence {index} has "
                    f"{length} tokens and needs at least one prompt token)"
                )
        unknown = sorted(set(sample_fields) - set(SampleFields.field_names()))
        if unknown:
            hint = [f"{n} -> {RENAMED_FIELDS[n]}" for n in unknown if n in RENAMED_FIELDS]
            raise ValueError(f"MicroBatch.pack: unknown fields {unknown}"
                             + (f" (renamed: {', '.join(hint)})" if hint else "")
                             + f"; known: {list(SampleFields.field_names())}")
        if sample_fields.get("loss_masks") is None:
            raise ValueError("MicroBatch.pack: loss_masks is required (one [R_i] mask per sequence)")
        prompt_lengths = [length - int(r) for length, r in zip(lengths, response_lengths)]
        layout = PackedLayout(lengths, prompt_lengths, cp_rank=groups.cp_rank, cp_size=groups.cp_size)
        tokens = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in sequences])
        return cls(layout=layout, tokens=tokens, response_lengths=[int(r) for r in response_lengths], **sample_fields)

    def model_inputs(self) -> tuple[torch.Tensor, list[int]]:
        """(this CP rank's tokens [T_local], the global padded lengths) for `stacx.models.forward_packed`."""
        return self.layout.slice_tokens(self.tokens), list(self.layout.padded_lengths)

    def model_routes(self) -> torch.Tensor:
        """This CP rank's routes [T_local, MoE layers, top_k] (or [T_local, layers * top_k] as SGLang sends
        them) int64, aligned with `model_inputs()`'s tokens; -1 on tokens no engine ran (each sequence's last,
        CP padding). Raises when the micro-batch carries no `routed_experts`."""
        if self.routed_experts is None:
            raise ValueError("this micro-batch carries no routed_experts: --use-routing-replay needs the rollout "
                             "engine to return them (docs/models.md, 'Routing replay')")
        pieces = []
        for index, (routes, length) in enumerate(zip(self.routed_experts, self.layout.lengths)):
            routes = torch.as_tensor(routes, dtype=torch.long)
            if routes.dim() not in (2, 3) or routes.shape[0] not in (length - 1, length):
                raise ValueError(f"routed_experts[{index}] has shape {tuple(routes.shape)}; sequence {index} has "
                                 f"{length} tokens, so [{length - 1}, MoE layers, top_k] was expected")
            missing = routes.new_full((length - routes.shape[0], *routes.shape[1:]), -1)
            pieces.append(torch.cat([routes, missing]))
        return self.layout.slice_tokens(torch.cat(pieces), fill=-1)

    def sequence_token_counts(self) -> list[int]:
        """n_i: loss tokens of each WHOLE response (the reducer's sequence_token_counts)."""
        return [int(n) for n in loss_token_counts(self.loss_masks)]


def pack_micro_batch(sequences: Sequence[torch.Tensor], response_lengths: Sequence[int], *,
                     groups: ProcessGroups | None = None, **sample_fields: Any) -> MicroBatch:
    """`MicroBatch.pack` (the name the first API used)."""
    return MicroBatch.pack(sequences, response_lengths, groups=groups, **sample_fields)


def model_inputs(batch: MicroBatch) -> tuple[torch.Tensor, list[int]]:
    """`batch.model_inputs()` (the name the first API used)."""
    return batch.model_inputs()


__all__ = [
    "MicroBatch", "PER_RESPONSE_FIELDS", "PER_SEQUENCE_FIELDS", "PER_TOKEN_FIELDS", "RENAMED_FIELDS", "SampleFields",
    "model_inputs", "pack_micro_batch",
]
