"""Run a built model on one CP rank's slice of a packed row and return its TP-local logits.

    padded = cp_padded_lengths(lengths, cp)
    tokens_local = pad_packed(tokens, lengths, padded)[local_positions(padded, cp_rank, cp)]
    logits = forward_packed(model, tokens_local, padded, groups)   # [T_local, V_pad/tp] fp32
    shard = forward_packed(model, tokens_local, padded, groups, lm_head="hidden")  # LMHeadShard
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch

from stacx.models.builder import hf_config_of, unwrap_model
from stacx.parallel.cp_layout import cu_seqlens, local_positions, position_ids, sequence_parallel_padding
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.lm_head import LMHeadShard, mask_vocab_padding


def packed_seq_params_for(padded_lengths: Sequence[int], groups: ProcessGroups):
    """megatron's thd PackedSeqParams for a packed row of sequences with these global padded lengths.

    The "padded" offsets are the global ones: megatron's thd RoPE divides them by cp to find
    each rank's chunks, and Stacx's core attention reads them to find sequence boundaries.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = cu_seqlens(padded_lengths)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    offsets = offsets.to(device)
    max_length = max(padded_lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=offsets,
        cu_seqlens_kv=offsets,
        cu_seqlens_q_padded=offsets,
        cu_seqlens_kv_padded=offsets,
        max_seqlen_q=max_length,
        max_seqlen_kv=max_length,
        cp_group=groups.cp,
    )


#: What `forward_packed` returns: the logits shard, or the LM head's inputs (`LMHeadShard`).
LM_HEAD_OUTPUTS = ("logits", "hidden")


def forward_packed(model, tokens: torch.Tensor, padded_lengths: Sequence[int], groups: ProcessGroups, *,
                   lm_head: str = "logits") -> torch.Tensor | LMHeadShard:
    """TP-local logits [T_local, V_pad/tp] (fp32) for this CP rank's slice `tokens` [T_local].

    padded_lengths: the GLOBAL per-sequence lengths, each a multiple of 2*cp (cp_padded_lengths).
    Columns of vocab padding (global id >= the real vocab size) hold float32 min, so a softmax
    over the padded vocab equals the softmax over the real vocab.

    lm_head="hidden": the output layer's matmul is skipped for this call and the LM head's inputs
    come back instead, `LMHeadShard(hidden [T_local, H] in the model's dtype, weight [V_pad/tp, H],
    vocab_size, tp_rank)`, whose `logits()` equals what lm_head="logits" returns. The weight is the
    parameter GPTModel hands its output layer (the tied embedding, or `output_layer.weight`), so a
    loss computed from it sends its gradient through megatron's DDP hooks as the matmul would.

    Sequence parallelism (a model built with sequence_parallel=True): megatron splits the row along
    the sequence over TP, so it must be a multiple of tp. A padding sequence is appended for the
    call where it is not (`sequence_parallel_padding`; it attends only to itself, and a MoE router
    leaves it out of its losses through megatron's padding_mask) and cut from the outputs. The output
    layer gathers the sequence back; with lm_head="hidden" the skipped layer's gather is done here
    (`output_layer_skipped`), so every TP rank holds all T_local rows.
    """
    if lm_head not in LM_HEAD_OUTPUTS:
        raise ValueError(f"lm_head must be one of {list(LM_HEAD_OUTPUTS)}, got {lm_head!r}")
    padded_lengths = [int(n) for n in padded_lengths]
    cp_size = groups.cp_size
    expected = sum(padded_lengths) // cp_size
    if tokens.dim() != 1 or tokens.numel() != expected:
        raise ValueError(
            f"tokens must be this CP rank's 1-D slice of {expected} tokens "
            f"(sum(padded_lengths)={sum(padded_lengths)} / cp={cp_size}), got shape {tuple(tokens.shape)}"
        )
    bad = [n for n in padded_lengths if n <= 0 or n % (2 * cp_size if cp_size > 1 else 1)]
    if bad:
        raise ValueError(f"padded_lengths {bad} are not positive multiples of 2*cp={2 * cp_size}")
    num_local = tokens.numel()
    gpt_model = unwrap_model(model)
    sp_padding = (sequence_parallel_padding(num_local, groups.tp_size, cp_size)
                  if getattr(gpt_model.config, "sequence_parallel", False) else 0)
    extra = {}
    if sp_padding:
        padded_lengths = padded_lengths + [sp_padding]
        tokens = torch.cat([tokens, tokens.new_zeros(sp_padding // cp_size)])
        if getattr(gpt_model.config, "num_moe_experts", None):
            extra["padding_mask"] = (torch.arange(tokens.numel()) >= num_local)[None]  # [1, T_local + pad], True = pad
    positions = position_ids(padded_lengths)[local_positions(padded_lengths, groups.cp_rank, cp_size)]
    params = packed_seq_params_for(padded_lengths, groups)
    device = params.cu_seqlens_q.device
    inputs = (tokens.to(device)[None], positions.to(device)[None], None)  # [1, T_local] each
    extra = {name: mask.to(device) for name, mask in extra.items()}
    if not gpt_model.post_process:
        # A pipeline stage before the last: its hidden states [T_local, 1, H] are the next stage's
        # input, handed on as they are (stacx.parallel.pipeline).
        return model(*inputs, packed_seq_params=params, **extra)
    vocab_size = hf_config_of(model).vocab_size
    if lm_head == "hidden":
        with output_layer_skipped(gpt_model, groups.tp) as head:
            hidden = model(*inputs, packed_seq_params=params, **extra)  # [1, T_local, H]: [s, b, h] -> [b, s, h]
        # A wrapper that returns fp32 outputs (megatron's Float16Module) would hand back upcast hidden
        # states: the head computes in its weight's dtype, so they go back to it (exactly).
        hidden = hidden[0, :num_local].to(head.weight.dtype)
        return LMHeadShard(hidden=hidden, weight=head.weight, vocab_size=vocab_size, tp_rank=groups.tp_rank)
    logits = model(*inputs, packed_seq_params=params, **extra)  # [1, T_local, V_pad/tp]
    logits = logits[0, :num_local].float()
    return mask_vocab_padding(logits, vocab_size, groups.tp_rank)


class _SkippedHead:
    """What `output_layer_skipped` records: the weight GPTModel handed its output layer."""

    weight: torch.Tensor | None = None


@contextmanager
def output_layer_skipped(gpt_model, tp_group=None):
    """For the calls inside, GPTModel's output layer returns its input `(hidden_states, None)` and
    records the weight it was given (`weight=` for tied embeddings, else its own `weight`).

    Under sequence parallelism the input is this TP rank's part of the sequence; it comes back
    gathered over `tp_group` (forward: all-gather; backward: this rank's rows of the gradient, which
    the fused LM-head kernel has already summed over TP). Only the instance's `forward` is replaced,
    and put back on exit. Refused where the hidden states would not be the full LM-head input: an
    output bias (e.g. a value head) and multi-token prediction (its heads read the output layer too).
    """
    # Imported here: megatron-core is slow to import, and `stacx.models` stays light for the driver.
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    config = gpt_model.config
    output_layer = gpt_model.output_layer
    problems = [
        what for what, present in (
            ("an output-layer bias (e.g. a value head)", getattr(output_layer, "bias", None) is not None),
            ("multi-token prediction", bool(getattr(gpt_model, "mtp_process", False) or getattr(config, "mtp_num_layers", None))),
        ) if present
    ]
    if problems:
        raise ValueError(f"forward_packed(lm_head='hidden') does not support {', '.join(problems)}; "
                         f"use lm_head='logits' (run setting --lm-head-log-probs logits)")
    head = _SkippedHead()

    def skip(hidden_states, weight=None, runtime_gather_output=None):
        head.weight = output_layer.weight if weight is None else weight
        if getattr(output_layer, "sequence_parallel", False):
            # Backward takes this rank's rows of dL/dh: the LM-head kernel sums dL/dh over TP itself
            # (megatron's copy_to_tensor_model_parallel_region in front of its unfused output layer).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=tp_group)  # [T, b, H]
        return hidden_states, None

    previous = output_layer.__dict__.get("forward")
    output_layer.forward = skip
    try:
        yield head
    finally:
        if previous is None:
            del output_layer.forward
        else:
            output_layer.forward = previous
