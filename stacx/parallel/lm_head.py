"""`LMHeadShard`: the language-model head's inputs on one rank, in place of its logits.

A role's forward pass can stop before the output layer (`forward_packed(..., lm_head="hidden")`)
and hand the specialization what the head would have multiplied:

    shard = LMHeadShard(hidden [T_local, H], weight [V_pad/tp, H], vocab_size, tp_rank)
    log_probs, entropy = shard.log_probs_and_entropy(targets, tp_group=..., temperature=...)
                                                          # fused: the [T_local, V_pad/tp] logits never exist
    logits = shard.logits()                               # [T_local, V_pad/tp] fp32, padding masked

`logits()` is what `forward_packed(..., lm_head="logits")` returns for the same call, for code
that really reads the logits (top-K, a user's own loss). Both paths exclude megatron's vocab
padding (global ids >= vocab_size in the last TP shard) the same way: `mask_vocab_padding`
fills those logits with float32 min, whose exp is exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from stacx.parallel.fused_lm_head_logprobs import fused_lm_head_log_probs_and_entropy


def mask_vocab_padding(logits_local: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Fill the columns of this TP shard whose global vocab id is >= vocab_size with float32 min."""
    shard_width = logits_local.shape[-1]
    first_id = tp_rank * shard_width
    if first_id + shard_width <= vocab_size:
        return logits_local
    column_ids = torch.arange(first_id, first_id + shard_width, device=logits_local.device)
    return logits_local.masked_fill(column_ids >= vocab_size, torch.finfo(torch.float32).min)


@dataclass(frozen=True, eq=False)
class LMHeadShard:
    """The LM head's inputs on this rank: z = hidden @ weight^T would be the logits shard."""

    hidden: torch.Tensor
    """Final hidden states [T_local, H] (after the final norm), in the model's dtype, replicated on TP."""
    weight: torch.Tensor
    """This rank's output-weight rows [V_pad/tp, H] (the parameter itself: its gradient reaches DDP)."""
    vocab_size: int
    """The real vocab; rows whose global id (tp_rank * V_pad/tp + row) is >= vocab_size are padding."""
    tp_rank: int
    """This rank's place in the TP group (which vocab rows `weight` holds)."""

    def __post_init__(self):
        if self.hidden.dim() != 2 or self.weight.dim() != 2 or self.hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(f"LMHeadShard needs hidden [T, H] and weight [V/tp, H] with one H; got hidden "
                             f"{tuple(self.hidden.shape)}, weight {tuple(self.weight.shape)}")
        if self.vocab_size < 1 or self.tp_rank < 0:
            raise ValueError(f"LMHeadShard needs vocab_size >= 1 and tp_rank >= 0, got {self.vocab_size}, {self.tp_rank}")

    @property
    def num_tokens(self) -> int:
        """T_local, the rows of the logits this shard stands for."""
        return self.hidden.shape[0]

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def logits(self) -> torch.Tensor:
        """The materialized logits shard [T_local, V_pad/tp], fp32, padding columns at float32 min
        (what the unfused forward returns); differentiable w.r.t. hidden and weight."""
        return mask_vocab_padding((self.hidden @ self.weight.t()).float(), self.vocab_size, self.tp_rank)

    def log_probs_and_entropy(
        self, target_ids: torch.Tensor, *, tp_group: dist.ProcessGroup | None, temperature: float = 1.0,
        with_entropy: bool = False, entropy_requires_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(target) [T_local] fp32 (and entropy [T_local]) by the fused kernel: the same values and
        gradients as `vocab_parallel_log_probs_and_entropy(self.logits(), ...)`, without the logits."""
        return fused_lm_head_log_probs_and_entropy(
            self.hidden, self.weight, target_ids, tp_group=tp_group, temperature=temperature,
            with_entropy=with_entropy, entropy_requires_grad=entropy_requires_grad, vocab_size=self.vocab_size,
        )


__all__ = ["LMHeadShard", "mask_vocab_padding"]
