"""Log-probs and entropy straight from final hidden states and the TP-sharded output weight.

The unfused path materializes the logits shard z = h W^T [T, V/tp] (and, in backward, its
gradient of the same size) before `vocab_parallel_log_probs_and_entropy` reads it. This module
computes the same values tile by tile, so no [T, V/tp] tensor ever exists:

    h [T, H] hidden states (replicated on the TP group),  W [V/tp, H] this rank's vocab rows
    tile: C tokens x B vocab rows,  z_CB = h_C W_B^T      [C, B]
    s = z / temperature,   lse_t = log sum_v exp(s_tv) over the FULL vocab
    log p(id | t) = s_t,id - lse_t,   H_t = lse_t - sum_v p_tv s_tv

Why tiles over vocab blocks and not only chunks of tokens: a chunk of C tokens against the whole
shard reads all of W (and read-modify-writes an fp32 dW) once per chunk, so at small C the matmuls
are bound by memory traffic (measured 3.6x the unfused time at C = 2 on CPU; on a GPU,
151,936 x 2048 bf16 is 0.6 GB per pass). The outer loop runs over vocab blocks W_B, the inner one
over token chunks (by default one chunk of all tokens up to 4096), so W is read once per pass
and each block of dW is written once.

Forward: per tile, the statistics of `vocab_parallel.local_chunk_statistics` (log-sum-exp, mean
of s, s at the ids the block owns) fill a small [blocks, rows, T] buffer and the tile is dropped.
`vocab_parallel.combine_shard_statistics` combines the blocks exactly as it combines TP shards;
then ONE all-gather of this rank's [rows, T] statistics over the TP group combines the ranks.

Backward: per tile, the logits are recomputed (one extra matmul: 4 instead of the unfused 3),
the softmax gradient g = d/dz [C, B] is formed with `vocab_parallel`'s own helper
(d log p(id)/ds_v = [v == id] - p_v, dH/ds_v = -p_v (log p_v + H), d/dz = (d/ds) / temperature),
rounded to the inputs' dtype as the unfused path does, and

    dL/dh_C += g W_B       [C, H]   (fp32 accumulator; partial: this rank's vocab rows only)
    dL/dW_B  = g^T h_C     [B, H]   (summed in fp32 over token chunks when there are several)

The hidden states feed every TP rank's shard, so their gradient is the sum of the partial
gradients over the TP group: ONE all-reduce of dL/dh [T, H] in backward (what megatron's
`copy_to_tensor_model_parallel_region` does in front of the unfused output layer).

Memory: saved for backward are h, W (both alive anyway), the ids, lse [T], and H [T] only when
entropy needs a gradient. Beyond the inputs' own gradients, the peak is the fp32 dL/dh
accumulator [T, H] plus a few tile-sized temporaries (the recomputed logits in the inputs'
dtype, two fp32 C x B buffers, the gradient cast back to the inputs' dtype): about
12 bytes * C * B for bf16, with B <= V/tp / 64 by default — never [T, V/tp].

Vocab padding: megatron pads the vocab to a multiple of tp, so the last shard's rows with a
global id >= `vocab_size` are not tokens. The unfused path fills their logits with float32 min
(exp of that is exactly 0: they add nothing to lse or entropy, and get no gradient); here the
tiles simply stop at the last real row, and those rows' weight gradient is 0. A shard that is
all padding contributes lse = -inf (and nothing else) to the combine.

Not handled: an output-layer bias (Qwen/Llama heads have none). The hidden states must be the full
[T, H] on every TP rank: under sequence parallelism `forward_packed` gathers them first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stacx.parallel.collectives import all_reduce_sum_, group_rank, group_size

# The softmax-gradient helper is the one `vocab_parallel` uses in its own backward: shared on
# purpose, so the fused and unfused gradients cannot drift apart.
from stacx.parallel.vocab_parallel import (
    VocabParallelOptions,
    _chunk_grad_s,
    combine_shard_statistics,
    entropy_output,
    gathered_log_probs,
    local_chunk_statistics,
    shifted_fp32_chunk,
)

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+
    from typing_extensions import Unpack


#: The default tile holds all tokens up to this many (one pass over the weight per block).
DEFAULT_MAX_CHUNK_TOKENS = 4096
#: The local vocab is cut into at least this many blocks, so the tile's few fp32 temporaries stay
#: under about 1/10 of the logits shard they replace (about 12 bytes * T * V/tp / 64 for bf16).
DEFAULT_VOCAB_BLOCKS = 64
#: ... and a tile holds at most this many logits (32 MiB per fp32 temporary).
DEFAULT_TILE_ELEMENTS = 1 << 23
#: Narrower blocks make the matmuls inefficient; small vocabularies take fewer, wider blocks.
MIN_VOCAB_BLOCK = 256


def tile_logits(hidden_CH: torch.Tensor, weight_BH: torch.Tensor) -> torch.Tensor:
    """z = h W^T for one tile: [C, H] x [B, H] -> [C, B] in the inputs' dtype."""
    return hidden_CH @ weight_BH.t()


def default_tile(num_tokens: int, vocab_local: int) -> tuple[int, int]:
    """(chunk_tokens, vocab_block) of the default tile.

    chunk_tokens = min(T, DEFAULT_MAX_CHUNK_TOKENS); vocab_block = min(V/tp, max(MIN_VOCAB_BLOCK,
    min(ceil(V/tp / DEFAULT_VOCAB_BLOCKS), DEFAULT_TILE_ELEMENTS // chunk_tokens))).
    """
    chunk_tokens = max(1, min(num_tokens, DEFAULT_MAX_CHUNK_TOKENS))
    by_fraction = -(-vocab_local // DEFAULT_VOCAB_BLOCKS)
    by_elements = DEFAULT_TILE_ELEMENTS // chunk_tokens
    return chunk_tokens, max(1, min(vocab_local, max(MIN_VOCAB_BLOCK, min(by_fraction, by_elements))))


def block_ids(local_ids_TK: torch.Tensor, owned_TK: torch.Tensor, block_start: int, block_end: int):
    """Ids relative to the vocab block [block_start, block_end) of the shard and where the block owns them."""
    owned_TK = owned_TK & (local_ids_TK >= block_start) & (local_ids_TK < block_end)
    return (local_ids_TK - block_start).clamp_(0, block_end - block_start - 1), owned_TK


class _FusedLMHeadLogProbs(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H], ids [T, K]) -> (log-probs [T, K] fp32, entropy [T] fp32 or empty)."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, ids_TK, tp_group, temperature, chunk_tokens, vocab_block,
                with_entropy, entropy_grad, vocab_size):
        ctx.set_materialize_grads(False)
        num_tokens = hidden_TH.shape[0]
        vocab_local = weight_VH.shape[0]
        vocab_start = group_rank(tp_group) * vocab_local
        # Rows [real_local, V/tp) are vocab padding: no tile ever reads them.
        real_local = real_rows(vocab_local, vocab_start, vocab_size)
        local_ids_TK = (ids_TK - vocab_start).clamp_(0, vocab_local - 1)
        owned_TK = (ids_TK >= vocab_start) & (ids_TK < vocab_start + vocab_local)
        rows = 1 + int(with_entropy) + ids_TK.shape[1]
        block_starts = range(0, real_local, vocab_block)
        # Each vocab block is combined like one more shard: [blocks, rows, T], then over TP.
        stats_brT = torch.empty(len(block_starts), rows, num_tokens, dtype=torch.float32, device=hidden_TH.device)
        for block, block_start in enumerate(block_starts):
            block_end = min(block_start + vocab_block, real_local)
            weight_BH = weight_VH[block_start:block_end]
            ids_in_block_TK, owned_by_block_TK = block_ids(local_ids_TK, owned_TK, block_start, block_end)
            for start in range(0, num_tokens, chunk_tokens):
                end = min(start + chunk_tokens, num_tokens)
                logits_CB = tile_logits(hidden_TH[start:end], weight_BH)
                stats_brT[block, :, start:end] = local_chunk_statistics(
                    logits_CB, temperature, ids_in_block_TK[start:end], owned_by_block_TK[start:end], with_entropy
                )
                del logits_CB
        if real_local:
            lse_T, entropy_T, s_ids_KT = combine_shard_statistics(stats_brT, with_entropy)
            # This rank's statistics in the layout of one shard: E_r[s] = lse_r - H_r.
            rank_rows = [lse_T.unsqueeze(0)] + ([(lse_T - entropy_T).unsqueeze(0)] if with_entropy else []) + [s_ids_KT]
            stats_rT = torch.cat(rank_rows, dim=0)
        else:  # all padding: weight exp(-inf - lse) = 0 in the combine, no id owned
            stats_rT = torch.zeros(rows, num_tokens, dtype=torch.float32, device=hidden_TH.device)
            stats_rT[0] = -torch.inf
        log_probs_TK, lse_T, entropy_T = gathered_log_probs(stats_rT, tp_group, with_entropy)

        ctx.tp_group, ctx.temperature = tp_group, temperature
        ctx.chunk_tokens, ctx.vocab_block, ctx.real_local = chunk_tokens, vocab_block, real_local
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(hidden_TH, weight_VH, local_ids_TK, owned_TK, lse_T, entropy_T if ctx.entropy_grad else None)
        return log_probs_TK, entropy_output(ctx, entropy_T, log_probs_TK)

    @staticmethod
    def backward(ctx, grad_log_probs_TK, grad_entropy_T):
        hidden_TH, weight_VH, local_ids_TK, owned_TK, lse_T, entropy_T = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy_T = None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_log_probs_TK is None and grad_entropy_T is None) or not (need_hidden or need_weight):
            return (None,) * 10
        grad_sum_T = None
        if grad_log_probs_TK is not None:
            # Every id's gradient reaches every shard through lse (the -p_v term: sum over all K);
            # the [v == id] term lands only on the block that owns the id.
            grad_sum_T = grad_log_probs_TK.float().sum(dim=1)
            grad_log_probs_TK = grad_log_probs_TK.float()
        entropy_terms_T = None if grad_entropy_T is None else (grad_entropy_T.float(), entropy_T)
        num_tokens, vocab_local = hidden_TH.shape[0], weight_VH.shape[0]
        one_chunk = ctx.chunk_tokens >= num_tokens
        # d/dhidden sums over vocab blocks: fp32 accumulator [T, H] (small next to [T, V/tp]).
        grad_hidden_TH = torch.zeros(hidden_TH.shape, dtype=torch.float32, device=hidden_TH.device) if need_hidden else None
        grad_weight_VH = torch.empty_like(weight_VH) if need_weight else None
        if need_weight:
            grad_weight_VH[ctx.real_local:] = 0  # padding rows: masked logits carry no gradient
        for block_start in range(0, ctx.real_local, ctx.vocab_block):
            block_end = min(block_start + ctx.vocab_block, ctx.real_local)
            weight_BH = weight_VH[block_start:block_end]
            ids_in_block_TK, owned_by_block_TK = block_ids(local_ids_TK, owned_TK, block_start, block_end)
            # Several token chunks add into an fp32 block accumulator; one chunk writes the block directly.
            grad_weight_acc_BH = None
            if need_weight and not one_chunk:
                grad_weight_acc_BH = torch.zeros(weight_BH.shape, dtype=torch.float32, device=weight_VH.device)
            for start in range(0, num_tokens, ctx.chunk_tokens):
                end = min(start + ctx.chunk_tokens, num_tokens)
                grad_z_CB = _tile_grad_logits(
                    tile_logits(hidden_TH[start:end], weight_BH), lse_T[start:end], ctx.temperature,
                    None if grad_sum_T is None else grad_sum_T[start:end],
                    None if entropy_terms_T is None else tuple(t[start:end] for t in entropy_terms_T),
                    None if grad_log_probs_TK is None else (
                        ids_in_block_TK[start:end], grad_log_probs_TK[start:end] * owned_by_block_TK[start:end]
                    ),
                ).to(hidden_TH.dtype)
                # Both matmuls in the inputs' dtype, as the unfused path's backward does.
                if need_hidden:
                    grad_hidden_TH[start:end] += grad_z_CB @ weight_BH
                if need_weight:
                    grad_weight_CB = grad_z_CB.t() @ hidden_TH[start:end]
                    if one_chunk:
                        grad_weight_VH[block_start:block_end] = grad_weight_CB
                    else:
                        grad_weight_acc_BH += grad_weight_CB
                    del grad_weight_CB
                del grad_z_CB
            if grad_weight_acc_BH is not None:
                grad_weight_VH[block_start:block_end] = grad_weight_acc_BH
        if need_hidden:
            grad_hidden_TH = all_reduce_sum_(grad_hidden_TH, ctx.tp_group).to(hidden_TH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None, None, None, None, None


def real_rows(vocab_local: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many of the shard's rows [vocab_start, vocab_start + V/tp) are real tokens (< vocab_size)."""
    if vocab_size is None:
        return vocab_local
    return max(0, min(vocab_local, vocab_size - vocab_start))


def _tile_grad_logits(logits_CB, lse_C, temperature, grad_sum_C, entropy_terms, id_terms) -> torch.Tensor:
    """d(objective)/d(logits) of one tile [C, B], fp32, with vocab_parallel's own softmax-gradient helper.

    id_terms: (ids in the block [C, K], upstream gradient at the ids, 0 where the block owns no id).
    """
    log_p_CB = shifted_fp32_chunk(logits_CB, temperature, lse_C)
    del logits_CB
    grad_s_CB = _chunk_grad_s(log_p_CB, grad_sum_C, entropy_terms)
    if id_terms is not None:
        grad_s_CB.scatter_add_(1, *id_terms)
    if temperature != 1.0:
        grad_s_CB.div_(temperature)
    return grad_s_CB


def fused_lm_head_log_probs_at_ids(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    vocab_block: int | None = None,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[..., k]) for K global ids per position, from hidden states and the weight shard.

    hidden: [..., H] (replicated on the TP group); weight: [V/tp, H], this rank's vocab rows
    [tp_rank * V/tp, (tp_rank + 1) * V/tp); ids: [..., K] int64 global vocab ids.
    Returns (log_probs [..., K] fp32, entropy [...] fp32 or None), differentiable w.r.t. hidden
    and weight. One all-gather over `tp_group` in forward, one all-reduce of d/dhidden in backward.
    The work goes in tiles of `chunk_tokens` x `vocab_block` logits (defaults: `default_tile`).
    vocab_size: the real vocab when the weight's rows are padded (rows with a global id >=
    vocab_size are excluded, as `mask_vocab_padding` excludes their logits); None: no padding.
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
    for name, value in (("chunk_tokens", chunk_tokens), ("vocab_block", vocab_block)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 (or None for the default), got {value}")
    vocab_local = weight.shape[0]
    padded_vocab = vocab_local * group_size(tp_group)
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab:
        raise ValueError(
            f"vocab_size must be the real vocab, in (0, V/tp * tp = {padded_vocab}], got {vocab_size} "
            f"(None when the weight has no padding rows)"
        )
    vocab_size = padded_vocab if vocab_size is None else int(vocab_size)
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, vocab_size={vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]"
        )
    leading = hidden.shape[:-1]
    hidden_TH = hidden.reshape(-1, hidden.shape[-1])
    ids_TK = ids.reshape(hidden_TH.shape[0], -1)
    default_chunk, default_block = default_tile(hidden_TH.shape[0], vocab_local)
    log_probs_TK, entropy_T = _FusedLMHeadLogProbs.apply(
        hidden_TH, weight, ids_TK, tp_group, float(temperature), chunk_tokens or default_chunk,
        min(vocab_block or default_block, vocab_local), with_entropy, entropy_requires_grad,
        None if vocab_size == padded_vocab else vocab_size,
    )
    log_probs = log_probs_TK.view(*leading, ids_TK.shape[1])
    return log_probs, (entropy_T.view(leading) if with_entropy else None)


class FusedLMHeadOptions(VocabParallelOptions, total=False):
    """The keyword options of `fused_lm_head_log_probs_at_ids`, which its per-token form
    (`fused_lm_head_log_probs_and_entropy`) passes on: those of the logits' form, and the vocab tiling."""

    vocab_block: int | None
    """Vocab rows per tile of logits (default None: `default_tile`)."""
    vocab_size: int | None
    """The real vocab when the weight's rows are padded (rows with a global id >= vocab_size are left out, as
    `mask_vocab_padding` leaves out their logits); default None: no padding."""


def fused_lm_head_log_probs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, **options: Unpack[FusedLMHeadOptions],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and (only when `with_entropy`) entropy, without the logits.

    hidden: [..., H]; weight: [V/tp, H]; target_ids: [...] global vocab ids.
    Returns (log_probs [...] fp32, entropy [...] fp32 or None). Same values and gradients as
    `vocab_parallel_log_probs_and_entropy(hidden @ weight.T, target_ids, ...)`. `options` (`FusedLMHeadOptions`):
    those of `fused_lm_head_log_probs_at_ids`, `with_entropy` defaulting to True.
    """
    log_probs, entropy = fused_lm_head_log_probs_at_ids(hidden, weight, target_ids.unsqueeze(-1),
                                                        **{"with_entropy": True, **options})
    return log_probs.squeeze(-1), entropy
