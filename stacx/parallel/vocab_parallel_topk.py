"""Top-k over a tensor-parallel vocab, and differentiable log-probs at arbitrary ids.

Top-k distillation with TP > 1 needs the student's k most likely tokens (global ids) and the
student's log-probs at a set of ids per position (its own top-k, the teacher's, or their
union). Each rank only sees a vocab shard, so:

- `vocab_parallel_topk`: each shard takes its local top-k (k values of its shard at most), the
  [tp, 2, T, k] candidates (values and global ids) travel in ONE all-gather, and the global
  top-k is the top-k of the tp*k candidates. Exact: a global top-k entry is in its shard's
  local top-k. Not differentiable (ids are discrete; values are returned detached).
- `vocab_parallel_log_probs_at_ids` (re-exported from vocab_parallel): log p(id) for K ids per
  position with exact gradients, one all-gather in forward, none in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stacx.parallel.collectives import all_gather_stacked, group_rank, group_size
from stacx.parallel.vocab_parallel import vocab_parallel_log_probs_at_ids

__all__ = ["vocab_parallel_topk", "vocab_parallel_log_probs_at_ids", "merge_shard_topk"]


def merge_shard_topk(values_rTk: torch.Tensor, ids_rTk: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k from per-shard candidates [tp, T, k_local] (values, global ids) -> [T, k] each."""
    tp, num_tokens, k_local = values_rTk.shape
    candidates_values = values_rTk.permute(1, 0, 2).reshape(num_tokens, tp * k_local)
    candidates_ids = ids_rTk.permute(1, 0, 2).reshape(num_tokens, tp * k_local)
    top_values, positions = candidates_values.topk(k, dim=-1)
    return top_values, candidates_ids.gather(1, positions)


@torch.no_grad()
def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits/temperature over the full vocab and their global ids.

    logits: [..., V/tp] this rank's shard. Returns (values [..., k] fp32, ids [..., k] int64),
    sorted by value descending; identical on every TP rank. One all-gather over `tp_group`.
    """
    vocab_local = logits.shape[-1]
    tp = group_size(tp_group)
    if not 1 <= k <= vocab_local * tp:
        raise ValueError(f"k must be in [1, vocab_size={vocab_local * tp}], got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    leading = logits.shape[:-1]
    logits_TV = logits.reshape(-1, vocab_local)
    k_local = min(k, vocab_local)
    local_values, local_ids = logits_TV.topk(k_local, dim=-1)
    global_ids = local_ids + group_rank(tp_group) * vocab_local
    # Values and ids in one float64 buffer (ids are exact in float64) -> one collective.
    packed = torch.stack([local_values.double(), global_ids.double()])
    gathered = all_gather_stacked(packed, tp_group)  # [tp, 2, T, k_local]
    values, ids = merge_shard_topk(gathered[:, 0], gathered[:, 1].long(), k)
    values = (values / temperature).float()
    return values.view(*leading, k), ids.view(*leading, k)
