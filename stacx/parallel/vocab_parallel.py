"""Log-probs and entropy from tensor-parallel logits, chunked so memory stays near the shard.

Each TP rank holds the logits shard z [T, V/tp] for vocab ids [tp_rank*V/tp, (tp_rank+1)*V/tp).
With s = z / temperature and lse_t = log sum_v exp(s_tv) over the FULL vocab:

    log p(id | t) = s_t,id - lse_t
    H_t           = lse_t - sum_v p_tv s_tv                    (entropy)

Forward, per chunk of tokens, each rank computes local statistics from its shard only:
lse_r (local log-sum-exp), E_r[s] (mean of s under the local softmax) and s at the requested
ids it owns (0 elsewhere). ONE all-gather of that small [tp, rows, T] buffer combines them:

    lse = logsumexp_r lse_r,   E[s] = sum_r exp(lse_r - lse) E_r[s],   s_id = sum_r s_id,r

Backward needs no communication (the gradient of lse is the local softmax p = exp(s - lse)):

    d log p(id_k) / d s_v = [v == id_k] - p_v
    d H / d s_v          = -p_v (log p_v + H)
    d / d z              = (d / d s) / temperature

What is kept for backward: the logits shard itself (already alive: it is the model's output),
the ids, and lse [T]; H [T] only when entropy needs a gradient. Softmax is recomputed per chunk
in backward, so the extra memory beyond the shard (and its gradient) is a couple of fp32
chunk-sized temporaries: chunk_tokens * V/tp * 4 bytes each, never [T, V].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+
    from typing_extensions import Unpack

from stacx.parallel.collectives import all_gather_stacked, group_rank, group_size

#: Default chunk budget in elements of the shard (32 MiB per fp32 temporary).
DEFAULT_CHUNK_ELEMENTS = 1 << 23
#: A chunk also holds at most 1/DEFAULT_CHUNKS_PER_BATCH of the tokens, so the two fp32 chunk
#: temporaries stay under 1/8 of even a bf16 shard for small batches.
DEFAULT_CHUNKS_PER_BATCH = 32


def default_chunk_tokens(num_tokens: int, vocab_local: int) -> int:
    """min(DEFAULT_CHUNK_ELEMENTS // vocab_local, ceil(num_tokens / DEFAULT_CHUNKS_PER_BATCH)), at least 1."""
    by_elements = DEFAULT_CHUNK_ELEMENTS // max(vocab_local, 1)
    by_fraction = -(-max(num_tokens, 1) // DEFAULT_CHUNKS_PER_BATCH)
    return max(1, min(by_elements, by_fraction))


def shifted_fp32_chunk(logits_CV: torch.Tensor, temperature: float, shift_C: torch.Tensor, out=None) -> torch.Tensor:
    """d = logits / temperature - shift[:, None] in fp32, as a fresh temporary or written into `out`.

    At temperature 1 this is one fused pass (the fp32 shift promotes bf16 logits); never an
    in-place change of the logits themselves. Below temperature 1 a vocab-padding column (float32
    min, `mask_vocab_padding`) would overflow to -inf, and exp(d) * d = 0 * -inf to NaN in the
    entropy: d is clamped back to float32 min, whose exp is still exactly 0.
    """
    if temperature == 1.0:
        return torch.sub(logits_CV, shift_C.unsqueeze(-1), out=out)
    d = logits_CV.to(torch.float32, copy=True) if out is None else out.copy_(logits_CV)
    return d.div_(temperature).sub_(shift_C.unsqueeze(-1)).clamp_(min=torch.finfo(torch.float32).min)


def local_chunk_statistics(
    logits_CV: torch.Tensor, temperature: float, local_ids_CK: torch.Tensor, owned_CK: torch.Tensor,
    with_entropy: bool,
) -> torch.Tensor:
    """Shard statistics of one chunk of logits [C, V/tp] (not modified).

    Returns [rows, C] fp32 with rows = lse_local, (E_local[s] if with_entropy), s at ids (K rows,
    0 where this shard does not own the id), where s = logits / temperature.
    """
    id_values_KC = (logits_CV.gather(1, local_ids_CK).float().div_(temperature) * owned_CK).t()
    max_C = logits_CV.amax(dim=-1).float().div_(temperature)
    shifted_CV = shifted_fp32_chunk(logits_CV, temperature, max_C)  # d = s - max, the one temporary
    if with_entropy:
        exp_CV = torch.exp(shifted_CV)
        sum_exp_C = exp_CV.sum(dim=-1)
        # sum_v exp(d_v) d_v as a batched dot product: no third [C, V] temporary.
        weighted_C = torch.bmm(exp_CV.unsqueeze(1), shifted_CV.unsqueeze(2)).view(-1)
        del exp_CV
        mean_s_C = max_C + weighted_C / sum_exp_C
        lse_C = max_C + torch.log(sum_exp_C)
        return torch.cat([lse_C.unsqueeze(0), mean_s_C.unsqueeze(0), id_values_KC], dim=0)
    sum_exp_C = shifted_CV.exp_().sum(dim=-1)
    lse_C = max_C + torch.log(sum_exp_C)
    return torch.cat([lse_C.unsqueeze(0), id_values_KC], dim=0)


def combine_shard_statistics(stats_RrT: torch.Tensor, with_entropy: bool):
    """Combine per-shard statistics [tp, rows, T] into (lse [T], entropy [T] or None, s_ids [K, T])."""
    lse_rT = stats_RrT[:, 0]
    lse_T = torch.logsumexp(lse_rT, dim=0)
    first_id_row = 2 if with_entropy else 1
    s_ids_KT = stats_RrT[:, first_id_row:].sum(dim=0)
    entropy_T = None
    if with_entropy:
        weights_rT = torch.exp(lse_rT - lse_T)
        entropy_T = lse_T - (weights_rT * stats_RrT[:, 1]).sum(dim=0)
    return lse_T, entropy_T, s_ids_KT


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logits [T, V/tp], ids [T, K]) -> (log-probs [T, K] fp32, entropy [T] fp32 or empty)."""

    @staticmethod
    def forward(ctx, logits_TV, ids_TK, tp_group, temperature, chunk_tokens, with_entropy, entropy_grad):
        ctx.set_materialize_grads(False)
        num_tokens, vocab_local = logits_TV.shape
        vocab_start = group_rank(tp_group) * vocab_local
        local_ids_TK = (ids_TK - vocab_start).clamp_(0, vocab_local - 1)
        owned_TK = (ids_TK >= vocab_start) & (ids_TK < vocab_start + vocab_local)
        rows = 1 + int(with_entropy) + ids_TK.shape[1]
        stats_rT = torch.empty(rows, num_tokens, dtype=torch.float32, device=logits_TV.device)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            stats_rT[:, start:end] = local_chunk_statistics(
                logits_TV[start:end], temperature, local_ids_TK[start:end], owned_TK[start:end], with_entropy
            )
        log_probs_TK, lse_T, entropy_T = gathered_log_probs(stats_rT, tp_group, with_entropy)

        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.entropy_grad = with_entropy and entropy_grad
        saved_entropy = entropy_T if ctx.entropy_grad else None
        ctx.save_for_backward(logits_TV, local_ids_TK, owned_TK, lse_T, saved_entropy)
        return log_probs_TK, entropy_output(ctx, entropy_T, log_probs_TK)

    @staticmethod
    def backward(ctx, grad_log_probs_TK, grad_entropy_T):
        logits_TV, local_ids_TK, owned_TK, lse_T, entropy_T = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy_T = None
        if grad_log_probs_TK is None and grad_entropy_T is None:
            return (None,) * 7
        grad_logits_TV = torch.empty_like(logits_TV)
        num_tokens = logits_TV.shape[0]
        if grad_log_probs_TK is not None:
            # Every id's gradient reaches every shard through lse (the -p_v term: sum over all K);
            # the [v == id] term lands only on the shard that owns the id.
            grad_sum_T = grad_log_probs_TK.float().sum(dim=1)
            grad_log_probs_TK = grad_log_probs_TK.float() * owned_TK
        # fp32 logits: compute each chunk's gradient directly in the gradient tensor (no temporary).
        in_place = grad_logits_TV.dtype == torch.float32
        for start in range(0, num_tokens, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, num_tokens)
            log_p_CV = shifted_fp32_chunk(
                logits_TV[start:end], ctx.temperature, lse_T[start:end], out=grad_logits_TV[start:end] if in_place else None
            )
            grad_s_CV = _chunk_grad_s(
                log_p_CV,
                None if grad_log_probs_TK is None else grad_sum_T[start:end],
                None if grad_entropy_T is None else (grad_entropy_T[start:end].float(), entropy_T[start:end]),
            )
            if grad_log_probs_TK is not None:
                grad_s_CV.scatter_add_(1, local_ids_TK[start:end], grad_log_probs_TK[start:end])
            if ctx.temperature != 1.0:
                grad_s_CV.div_(ctx.temperature)
            if not in_place:
                grad_logits_TV[start:end].copy_(grad_s_CV)
            del log_p_CV, grad_s_CV
        return grad_logits_TV, None, None, None, None, None, None


def gathered_log_probs(stats_rT: torch.Tensor, tp_group, with_entropy: bool):
    """(log_probs_TK, lse_T, entropy_T or None) from every TP shard's statistics: ONE all-gather."""
    lse_T, entropy_T, s_ids_KT = combine_shard_statistics(all_gather_stacked(stats_rT, tp_group), with_entropy)
    return (s_ids_KT - lse_T).t().contiguous(), lse_T, entropy_T


def entropy_output(ctx, entropy_T: torch.Tensor | None, log_probs_TK: torch.Tensor) -> torch.Tensor:
    """The entropy a forward returns: an empty tensor when not computed, non-differentiable when no
    gradient flows through it (autograd then skips its backward terms)."""
    if entropy_T is None:
        entropy_T = log_probs_TK.new_empty(0)
    if not ctx.entropy_grad:
        ctx.mark_non_differentiable(entropy_T)
    return entropy_T


def _chunk_grad_s(log_p_CV: torch.Tensor, grad_sum_C, entropy_terms) -> torch.Tensor:
    """Softmax part of d/ds for one chunk, computed in place in `log_p_CV` (returned).

    grad_s_v = -p_v * (sum_k g_k)  -  g_H * p_v * (log p_v + H)      (the id term is added by the caller)
    """
    if entropy_terms is None:
        p_CV = log_p_CV.exp_()
        return p_CV.mul_(-grad_sum_C.unsqueeze(-1))
    grad_entropy_C, entropy_C = entropy_terms
    p_CV = torch.exp(log_p_CV)
    coefficient_CV = log_p_CV.add_(entropy_C.unsqueeze(-1)).mul_(-grad_entropy_C.unsqueeze(-1))
    if grad_sum_C is not None:
        coefficient_CV.sub_(grad_sum_C.unsqueeze(-1))
    return coefficient_CV.mul_(p_CV)


class VocabParallelOptions(TypedDict, total=False):
    """The keyword options of `vocab_parallel_log_probs_at_ids`, which its per-token form
    (`vocab_parallel_log_probs_and_entropy`) passes on."""

    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group the vocab is sharded over (default None: one rank holds it all)."""
    temperature: float
    """The logits are divided by it before the softmax (> 0; default 1)."""
    chunk_tokens: int | None
    """Positions per chunk of the computation (default None: `default_chunk_tokens`)."""
    with_entropy: bool
    """Also return the entropy of each position's distribution (default False; True for the per-token form)."""
    entropy_requires_grad: bool
    """False (entropy coefficient 0): a detached entropy, and no entropy state kept for backward (default True)."""


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, target_ids: torch.Tensor, **options: Unpack[VocabParallelOptions],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and entropy from this rank's TP logits shard.

    logits: [..., V/tp] (any float dtype; math in fp32). target_ids: [...] global vocab ids.
    Returns (log_probs [...] fp32, entropy [...] fp32 or None when with_entropy is False).
    `options` (`VocabParallelOptions`): those of `vocab_parallel_log_probs_at_ids`, `with_entropy` defaulting
    to True. One all-gather over `tp_group` in forward, none in backward.
    """
    log_probs, entropy = vocab_parallel_log_probs_at_ids(logits, target_ids.unsqueeze(-1),
                                                         **{"with_entropy": True, **options})
    return log_probs.squeeze(-1), entropy


def vocab_parallel_log_probs(logits, target_ids, *, tp_group=None, temperature=1.0, chunk_tokens=None):
    """log p(target) per token, [...] fp32 (see vocab_parallel_log_probs_and_entropy)."""
    log_probs, _ = vocab_parallel_log_probs_and_entropy(
        logits, target_ids, tp_group=tp_group, temperature=temperature, chunk_tokens=chunk_tokens,
        with_entropy=False,
    )
    return log_probs


def vocab_parallel_entropy(logits, *, tp_group=None, temperature=1.0, chunk_tokens=None):
    """Entropy of softmax(logits / temperature) per token, [...] fp32, differentiable."""
    ids = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    log_probs, entropy = vocab_parallel_log_probs_at_ids(
        logits, ids.unsqueeze(-1), tp_group=tp_group, temperature=temperature, chunk_tokens=chunk_tokens,
        with_entropy=True, entropy_requires_grad=True,
    )
    return entropy


def vocab_parallel_log_probs_at_ids(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[..., k]) for K global ids per position from the TP shard, differentiable.

    logits: [..., V/tp]; ids: [..., K] int64 global vocab ids (duplicates allowed).
    Returns (log_probs [..., K] fp32, entropy [...] fp32 or None).
    """
    if logits.dim() < 1 or ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(
            f"ids must have shape [..., K] with the logits' leading shape {tuple(logits.shape[:-1])}, "
            f"got {tuple(ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (or None for the default), got {chunk_tokens}")
    vocab_local = logits.shape[-1]
    vocab_size = vocab_local * group_size(tp_group)
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, vocab_size={vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]"
        )
    leading = logits.shape[:-1]
    logits_TV = logits.reshape(-1, vocab_local)
    ids_TK = ids.reshape(logits_TV.shape[0], -1)
    chunk = chunk_tokens or default_chunk_tokens(logits_TV.shape[0], vocab_local)
    log_probs_TK, entropy_T = _VocabParallelLogProbs.apply(
        logits_TV, ids_TK, tp_group, float(temperature), chunk, with_entropy, entropy_requires_grad
    )
    log_probs = log_probs_TK.view(*leading, ids_TK.shape[1])
    return log_probs, (entropy_T.view(leading) if with_entropy else None)
