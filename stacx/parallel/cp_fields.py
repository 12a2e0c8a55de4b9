"""Per-token fields of a packed micro-batch under context parallelism.

A packed micro-batch holds S sequences back to back; sequence i has `lengths[i]` tokens, of
which the first `prompt_lengths[i]` are prompt and the rest (R_i = lengths[i] - prompt_lengths[i])
are the response. CP rank r holds, of every sequence padded to a multiple of 2*cp, chunks r and
2*cp-1-r (see cp_layout). `PackedLayout` is the one object that knows where everything went.

Alignment convention. Logits at position p predict the token at p+1, so every response field
(log-probs, teacher log-probs, masks, advantages) is aligned to PREDICTION positions: response
token j of sequence i is predicted at sequence position prompt_lengths[i] - 1 + j. A rank's local
response tokens are the local positions whose prediction lands in a response.

    layout = PackedLayout(lengths, prompt_lengths, cp_rank=groups.cp_rank, cp_size=groups.cp_size)
    tokens_local  = layout.slice_tokens(tokens)                       # model input  [T_local]
    targets_local = layout.slice_tokens(next_token_targets(tokens, lengths))
    log_probs_local = vocab_parallel_log_probs(logits_local, targets_local, tp_group=groups.tp)
    log_probs = layout.split_local_responses(log_probs_local)        # list: this rank's part of each response
    old_log_probs = layout.slice_responses(rollout_log_probs)        # same slicing for any field
    full = layout.gather_responses(log_probs_local, groups.cp)       # list: whole responses, one collective

Everything but `gather_responses` is index arithmetic computed once per micro-batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from stacx.parallel.collectives import gather_from_context_parallel, group_size
from stacx.parallel.cp_layout import cp_padded_lengths, cu_seqlens, local_positions, pad_packed, position_ids


def next_token_targets(tokens_T: torch.Tensor, lengths: Sequence[int], fill: int = 0) -> torch.Tensor:
    """Per packed position, the id of the next token of the same sequence ([T], `fill` at each last token)."""
    targets = torch.roll(tokens_T, shifts=-1, dims=0).clone()
    ends = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.long), 0) - 1
    targets[ends[ends >= 0]] = fill
    return targets


class PackedLayout:
    """Where each token of a packed micro-batch lives on one CP rank (pure index math).

    lengths: tokens per sequence (prompt + response), unpadded. prompt_lengths: prompt tokens per
    sequence, each >= 1 (the first token has no prediction). cp_rank / cp_size: this rank's slot.
    """

    def __init__(self, lengths: Sequence[int], prompt_lengths: Sequence[int], *, cp_rank: int = 0, cp_size: int = 1):
        self.lengths = [int(n) for n in lengths]
        self.prompt_lengths = [int(n) for n in prompt_lengths]
        if len(self.lengths) != len(self.prompt_lengths):
            raise ValueError(
                f"lengths ({len(self.lengths)} sequences) and prompt_lengths ({len(self.prompt_lengths)}) differ in size"
            )
        for i, (length, prompt) in enumerate(zip(self.lengths, self.prompt_lengths)):
            if not 1 <= prompt <= length:
                raise ValueError(f"prompt_lengths[{i}]={prompt} must be in [1, lengths[{i}]={length}]")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank {cp_rank} is not in [0, cp_size={cp_size})")
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.response_lengths = [n - p for n, p in zip(self.lengths, self.prompt_lengths)]
        self.padded_lengths = cp_padded_lengths(self.lengths, cp_size)
        self.local_positions = local_positions(self.padded_lengths, cp_rank, cp_size)  # [T_local]
        self._build_response_index()

    # ---- index math -------------------------------------------------------------------------

    def _global_response_positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For every response token of the micro-batch: (padded global prediction position, sequence, offset)."""
        starts = cu_seqlens(self.padded_lengths)[:-1].long()
        positions, sequences, offsets = [], [], []
        for i, (start, prompt, response) in enumerate(zip(starts.tolist(), self.prompt_lengths, self.response_lengths)):
            positions.append(torch.arange(start + prompt - 1, start + prompt - 1 + response))
            sequences.append(torch.full((response,), i, dtype=torch.long))
            offsets.append(torch.arange(response))
        if not positions:
            empty = torch.zeros(0, dtype=torch.long)
            return empty, empty, empty
        return torch.cat(positions), torch.cat(sequences), torch.cat(offsets)

    def _build_response_index(self) -> None:
        padded_total = sum(self.padded_lengths)
        global_positions, sequences, offsets = self._global_response_positions()
        # Map padded global position -> response token number (or -1).
        response_number = torch.full((padded_total,), -1, dtype=torch.long)
        response_number[global_positions] = torch.arange(global_positions.numel())
        local_numbers = response_number[self.local_positions]
        is_response = local_numbers >= 0
        #: Indices into the local row of this rank's response prediction positions, in local order.
        self.local_response_index = torch.nonzero(is_response).view(-1)
        numbers = local_numbers[is_response]
        self.local_response_sequence = sequences[numbers]
        #: For each sequence, the response offsets (0..R_i-1) this rank holds, increasing.
        self.local_response_offsets = [
            offsets[numbers][self.local_response_sequence == i] for i in range(len(self.lengths))
        ]
        self._local_split_sizes = [int(o.numel()) for o in self.local_response_offsets]
        # Sequences' local pieces are contiguous in local order (a rank's row is sequence by sequence).
        # For gather_responses: where response token n sits in the [cp * T_local] all-gathered row.
        num_local = self.local_positions.numel()
        gathered_slot = torch.full((padded_total,), -1, dtype=torch.long)
        for rank in range(self.cp_size):
            gathered_slot[local_positions(self.padded_lengths, rank, self.cp_size)] = (
                torch.arange(num_local) + rank * num_local
            )
        self._gather_index = gathered_slot[global_positions]

    @property
    def num_local_tokens(self) -> int:
        return int(self.local_positions.numel())

    def local_position_ids(self) -> torch.Tensor:
        """Position of each local token inside its own sequence (RoPE positions), [T_local]."""
        return position_ids(self.padded_lengths)[self.local_positions]

    def cu_seqlens_padded(self) -> torch.Tensor:
        """Global cumulative padded lengths (int32), what CP attention kernels take for packed batches."""
        return cu_seqlens(self.padded_lengths)

    # ---- slicing (no communication) ------------------------------------------------------------

    def slice_tokens(self, field: torch.Tensor, fill=0) -> torch.Tensor:
        """A packed per-token field [sum(lengths), ...] -> this rank's [T_local, ...] (padding = `fill`)."""
        if field.shape[0] != sum(self.lengths):
            raise ValueError(f"packed field has {field.shape[0]} tokens, the layout has {sum(self.lengths)}")
        padded = pad_packed(field, self.lengths, self.padded_lengths, fill=fill)
        return padded[self.local_positions.to(field.device)]

    def split_local_responses(self, local_values: torch.Tensor) -> list[torch.Tensor]:
        """Values at local prediction positions [T_local, ...] -> per sequence, this rank's response part."""
        if local_values.shape[0] != self.num_local_tokens:
            raise ValueError(f"local field has {local_values.shape[0]} tokens, this rank holds {self.num_local_tokens}")
        picked = local_values.index_select(0, self.local_response_index.to(local_values.device))
        return list(picked.split(self._local_split_sizes))

    def slice_responses(self, responses: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Full per-sequence response fields [R_i, ...] -> this rank's parts, aligned with split_local_responses.

        Works for any per-token field: rollout or teacher log-probs ([R_i] or [R_i, K]), loss masks,
        advantages, and for full tensors from gather_responses (to bring a sequence-level result back
        to this rank's tokens).
        """
        if len(responses) != len(self.lengths):
            raise ValueError(f"got {len(responses)} response tensors for {len(self.lengths)} sequences")
        pieces = []
        for i, (values, offsets) in enumerate(zip(responses, self.local_response_offsets)):
            if values.shape[0] != self.response_lengths[i]:
                raise ValueError(
                    f"response field of sequence {i} has {values.shape[0]} tokens, expected {self.response_lengths[i]}"
                )
            pieces.append(values.index_select(0, offsets.to(values.device)))
        return pieces

    # ---- the one collective -----------------------------------------------------------------

    def gather_responses(self, local_values: torch.Tensor, cp_group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """Whole responses on every CP rank from local values [T_local, ...]: one all-gather, differentiable.

        Stack several fields on a trailing dim to move them in the same collective. The result is a
        replica on every CP rank; backward sums gradients over CP (see docs/parallel.md: a loss
        built from it must count each token or sequence once across CP).
        """
        if group_size(cp_group) != self.cp_size:
            raise ValueError(f"cp_group has {group_size(cp_group)} ranks, the layout was built for cp_size={self.cp_size}")
        if local_values.shape[0] != self.num_local_tokens:
            raise ValueError(f"local field has {local_values.shape[0]} tokens, this rank holds {self.num_local_tokens}")
        gathered = gather_from_context_parallel(local_values, cp_group)  # [cp, T_local, ...]
        flat = gathered.reshape(-1, *local_values.shape[1:])
        picked = flat.index_select(0, self._gather_index.to(flat.device))
        return list(picked.split(self.response_lengths))
