"""Build the `batch` dict a specialization receives, and the model input it implies.

    batch = pack_micro_batch([prompt_and_response_ids, ...], response_lengths, groups=groups,
                             loss_masks=[...], rollout_log_probs=[...], advantages=[...])
    logits = forward_packed(model, *model_inputs(batch), groups)
    loss, metric_sums = specialization.compute_loss(logits, batch, reducer)

Per-response fields are passed whole (one tensor per sequence, [R_i] or [R_i, K]); the
specialization slices them for this CP rank. Pure index arithmetic, no communication.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stacx.parallel.cp_fields import PackedLayout
from stacx.parallel.groups import ProcessGroups


def pack_micro_batch(
    sequences: Sequence[torch.Tensor],
    response_lengths: Sequence[int],
    *,
    groups: ProcessGroups | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The batch dict for one packed micro-batch on this rank.

    sequences: token ids of each sequence, prompt then response ([L_i] int). response_lengths:
    R_i per sequence (the prompt is the first L_i - R_i >= 1 tokens). fields: per-response lists
    (`loss_masks`, `advantages`, ...) or per-sequence values (`pair_ids`), stored unchanged.
    Returns {"layout": PackedLayout, "tokens": [sum L_i] int64, "response_lengths": [R_i] ints, **fields}.
    """
    groups = groups if groups is not None else ProcessGroups.single_process()
    if len(sequences) != len(response_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(response_lengths)} response_lengths")
    if not sequences:
        raise ValueError("a micro-batch needs at least one sequence")
    lengths = [int(torch.as_tensor(s).shape[0]) for s in sequences]
    prompt_lengths = []
    for index, (length, response) in enumerate(zip(lengths, response_lengths)):
        if not 1 <= int(response) <= length - 1:
            raise ValueError(
                f"response_lengths[{index}]={response} must be in [1, {length - 1}] (sequence {index} has {length} "
                "tokens and needs at least one prompt token)"
            )
        prompt_lengths.append(length - int(response))
    layout = PackedLayout(lengths, prompt_lengths, cp_rank=groups.cp_rank, cp_size=groups.cp_size)
    tokens = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in sequences])
    reserved = {"layout", "tokens"} & set(fields)
    if reserved:
        raise ValueError(f"fields {sorted(reserved)} are built by pack_micro_batch; do not pass them")
    return {"layout": layout, "tokens": tokens, "response_lengths": [int(r) for r in response_lengths], **fields}


def model_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """(this CP rank's tokens [T_local], the global padded lengths) for `stacx.models.forward_packed`."""
    layout: PackedLayout = batch["layout"]
    return layout.slice_tokens(batch["tokens"]), list(layout.padded_lengths)


__all__ = ["model_inputs", "pack_micro_batch"]
