"""Log-probs and entropy straight from final hidden states and the TP-sharded output weight.

The unfused path materializes the logits shard z = h W^T [T, V/tp] (and, in backward, its
gradient of the same size) before `vocab_parallel_log_probs_and_entropy` reads it. This module
computes the same values chunk by chunk of tokens, so no [T, V/tp] tensor ever exists:

    h [T, H] hidden states (replicated on the TP group),  W [V/tp, H] this rank's vocab rows
    z_C = h_C W^T                                          [C, V/tp], one chunk of C tokens
    s = z / temperature,   lse_t = log sum_v exp(s_tv) over the FULL vocab
    log p(id | t) = s_t,id - lse_t,   H_t = lse_t - sum_v p_tv s_tv

Forward: per chunk, the shard statistics of `vocab_parallel.local_chunk_statistics` (local
log-sum-exp, local mean of s, s at the owned ids) are written into a small [rows, T] buffer and
the chunk's logits are dropped. ONE all-gather of that buffer over the TP group and
`vocab_parallel.combine_shard_statistics` give lse, entropy and s at the ids.

Backward: per chunk, the logits are recomputed (one extra [C, H] x [H, V/tp] matmul), the
softmax gradient g_C = d/dz [C, V/tp] is formed exactly as in `vocab_parallel` (same helpers:
d log p(id)/ds_v = [v == id] - p_v, dH/ds_v = -p_v (log p_v + H), d/dz = (d/ds) / temperature), and

    dL/dh_C  = g_C W       [C, H]      (partial: this rank's vocab rows only)
    dL/dW   += g_C^T h_C   [V/tp, H]

The hidden states feed every TP rank's shard, so their gradient is the sum of the partial
gradients over the TP group: ONE all-reduce of dL/dh [T, H] in backward (what megatron's
`copy_to_tensor_model_parallel_region` does in front of the unfused output layer).

Memory: saved for backward are h, W (both alive anyway), the ids, lse [T] and H [T] only when
entropy needs a gradient. Beyond the inputs' own gradients (dL/dh [T, H]; dL/dW [V/tp, H] kept in
fp32 while it accumulates), the peak is a few chunk-sized temporaries: the recomputed logits
(C * V/tp in the input dtype), two fp32 C * V/tp buffers and the gradient cast back to the input
dtype — never [T, V/tp]. At the default chunk (`default_chunk_tokens`: at most 2^23 elements and
1/32 of the tokens) that is about 12 bytes * C * V/tp for bf16.

Not handled: an output-layer bias (Qwen/Llama heads have none) and sequence parallelism (the
hidden states must be the full [T, H] on every TP rank, as without sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stacx.parallel.collectives import all_gather_stacked, all_reduce_sum_, group_rank, group_size

# The softmax-gradient helper is the one `vocab_parallel` uses in its own backward: shared on
# purpose, so the fused and unfused gradients cannot drift apart.
from stacx.parallel.vocab_parallel import (
    _chunk_grad_s,
    combine_shard_statistics,
    default_chunk_tokens,
    local_chunk_statistics,
    shifted_fp32_chunk,
)


def chunk_logits(hidden_CH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """z = h W^T for one chunk: [C, H] x [V/tp, H] -> [C, V/tp] in the inputs' dtype."""
    return hidden_CH @ weight_VH.t()


class _FusedLMHeadLogProbs(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H], ids [T, K]) -> (log-probs [T, K] fp32, entropy [T] fp32 or empty)."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, ids_TK, tp_group, temperature, chunk_tokens, with_entropy, entropy_grad):
        ctx.set_materialize_grads(False)
        num_tokens = hidden_TH.shape[0]
        vocab_local = weight_VH.shape[0]
        vocab_start = group_rank(tp_group) * vocab_local
        local_ids_TK = (ids_TK - vocab_start).clamp_(0, vocab_local - 1)
        owned_TK = (ids_TK >= vocab_start) & (ids_TK < vocab_start + vocab_local)
        rows = 1 + int(with_entropy) + ids_TK.shape[1]
        stats_rT = torch.empty(rows, num_tokens, dtype=torch.float32, device=hidden_TH.device)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            logits_CV = chunk_logits(hidden_TH[start:end], weight_VH)
            stats_rT[:, start:end] = local_chunk_statistics(
                logits_CV, temperature, local_ids_TK[start:end], owned_TK[start:end], with_entropy
            )
            del logits_CV
        lse_T, entropy_T, s_ids_KT = combine_shard_statistics(all_gather_stacked(stats_rT, tp_group), with_entropy)
        log_probs_TK = (s_ids_KT - lse_T).t().contiguous()

        ctx.tp_group, ctx.temperature, ctx.chunk_tokens = tp_group, temperature, chunk_tokens
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(hidden_TH, weight_VH, local_ids_TK, owned_TK, lse_T, entropy_T if ctx.entropy_grad else None)
        if entropy_T is None:
            entropy_T = log_probs_TK.new_empty(0)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy_T)
        return log_probs_TK, entropy_T

    @staticmethod
    def backward(ctx, grad_log_probs_TK, grad_entropy_T):
        hidden_TH, weight_VH, local_ids_TK, owned_TK, lse_T, entropy_T = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy_T = None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_log_probs_TK is None and grad_entropy_T is None) or not (need_hidden or need_weight):
            return (None,) * 8
        if grad_log_probs_TK is not None:
            # Every id's gradient reaches every shard through lse (the -p_v term: sum over all K);
            # the [v == id] term lands only on the shard that owns the id.
            grad_sum_T = grad_log_probs_TK.float().sum(dim=1)
            grad_log_probs_TK = grad_log_probs_TK.float() * owned_TK
        grad_hidden_TH = torch.empty_like(hidden_TH) if need_hidden else None
        # Accumulated over chunks in fp32 (one rounding at the end, as one unfused matmul would).
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_weight else None
        num_tokens = hidden_TH.shape[0]
        for start in range(0, num_tokens, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, num_tokens)
            hidden_CH = hidden_TH[start:end]
            logits_CV = chunk_logits(hidden_CH, weight_VH)
            log_p_CV = shifted_fp32_chunk(logits_CV, ctx.temperature, lse_T[start:end])
            del logits_CV
            grad_s_CV = _chunk_grad_s(
                log_p_CV,
                None if grad_log_probs_TK is None else grad_sum_T[start:end],
                None if grad_entropy_T is None else (grad_entropy_T[start:end].float(), entropy_T[start:end]),
            )
            if grad_log_probs_TK is not None:
                grad_s_CV.scatter_add_(1, local_ids_TK[start:end], grad_log_probs_TK[start:end])
            if ctx.temperature != 1.0:
                grad_s_CV.div_(ctx.temperature)
            # The unfused path rounds d/dz to the logits' dtype before its matmuls: do the same.
            grad_z_CV = grad_s_CV if hidden_TH.dtype == torch.float32 else grad_s_CV.to(hidden_TH.dtype)
            if need_hidden:
                torch.matmul(grad_z_CV, weight_VH, out=grad_hidden_TH[start:end])
            if need_weight:
                if grad_z_CV is not grad_s_CV:
                    grad_s_CV.copy_(grad_z_CV)  # the rounded values, accumulated in fp32 without a new buffer
                grad_weight_VH.addmm_(grad_s_CV.t(), hidden_CH.float())
            del log_p_CV, grad_s_CV, grad_z_CV
        if need_hidden:
            all_reduce_sum_(grad_hidden_TH, ctx.tp_group)
        if need_weight:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None, None, None


def fused_lm_head_log_probs_at_ids(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[..., k]) for K global ids per position, from hidden states and the weight shard.

    hidden: [..., H] (replicated on the TP group); weight: [V/tp, H], this rank's vocab rows
    [tp_rank * V/tp, (tp_rank + 1) * V/tp); ids: [..., K] int64 global vocab ids.
    Returns (log_probs [..., K] fp32, entropy [...] fp32 or None), differentiable w.r.t. hidden
    and weight. One all-gather over `tp_group` in forward, one all-reduce of d/dhidden in backward.
    """
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be the output layer's shard [V/tp, H] with H = hidden.shape[-1] = "
            f"{hidden.shape[-1] if hidden.dim() else None}; got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; cast one of them")
    if ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ids must have shape [..., K] with the hidden states' leading shape {tuple(hidden.shape[:-1])}, "
            f"got {tuple(ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (or None for the default), got {chunk_tokens}")
    vocab_local = weight.shape[0]
    vocab_size = vocab_local * group_size(tp_group)
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, vocab_size={vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]"
        )
    leading = hidden.shape[:-1]
    hidden_TH = hidden.reshape(-1, hidden.shape[-1])
    ids_TK = ids.reshape(hidden_TH.shape[0], -1)
    chunk = chunk_tokens or default_chunk_tokens(hidden_TH.shape[0], vocab_local)
    log_probs_TK, entropy_T = _FusedLMHeadLogProbs.apply(
        hidden_TH, weight, ids_TK, tp_group, float(temperature), chunk, with_entropy, entropy_requires_grad
    )
    log_probs = log_probs_TK.view(*leading, ids_TK.shape[1])
    return log_probs, (entropy_T.view(leading) if with_entropy else None)


def fused_lm_head_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = True,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and (only when `with_entropy`) entropy, without the logits.

    hidden: [..., H]; weight: [V/tp, H]; target_ids: [...] global vocab ids.
    Returns (log_probs [...] fp32, entropy [...] fp32 or None). Same values and gradients as
    `vocab_parallel_log_probs_and_entropy(hidden @ weight.T, target_ids, ...)`;
    `entropy_requires_grad=False` returns a detached entropy and keeps no entropy state.
    """
    log_probs, entropy = fused_lm_head_log_probs_at_ids(
        hidden, weight, target_ids.unsqueeze(-1), tp_group=tp_group, temperature=temperature,
        chunk_tokens=chunk_tokens, with_entropy=with_entropy, entropy_requires_grad=entropy_requires_grad,
    )
    return log_probs.squeeze(-1), entropy
