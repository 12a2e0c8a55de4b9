"""Which LM-head output a role's forward pass produces for one micro-batch: logits or `LMHeadShard`.

The run setting `lm_head_log_probs` (`--lm-head-log-probs`):

- `logits`: always the materialized fp32 logits shard [T_local, V_pad/tp] (the unfused path).
- `fused`: the LM head's inputs (`forward_packed(..., lm_head="hidden")`), so log-probs come from
  the fused kernel, wherever the specialization allows it (`Specialization.receives_logits()`
  False); a specialization that needs the logits still gets them.
- `auto`: fused where the specialization allows it AND either the model runs on CUDA or the
  micro-batch's fp32 logits shard, T_local x V_pad/tp x 4 bytes, would reach
  `AUTO_FUSED_LOGITS_BYTES`. On CPU the fused path costs 1.01-1.4x the unfused time (it recomputes
  the logits in backward; docs/performance.md), so there it is chosen only where the memory matters.

A value-head role (critic) has no LM head: always its values.
"""

from __future__ import annotations

from stacx.trainer.config.run import FIELD_CHOICES

#: The values of the run setting (declared once, with the setting: `FIELD_CHOICES`).
LM_HEAD_LOG_PROBS_MODES = FIELD_CHOICES["lm_head_log_probs"]
#: `auto` fuses on CPU from this size of the fp32 logits shard of one micro-batch on.
AUTO_FUSED_LOGITS_BYTES = 1 << 30


def logits_shard_bytes(num_local_tokens: int, vocab_local: int) -> int:
    """Bytes of the fp32 logits shard [T_local, V_pad/tp] that the unfused path materializes."""
    return 4 * int(num_local_tokens) * int(vocab_local)


def choose_lm_head_output(mode: str, *, specialization_allows: bool, on_cuda: bool, num_local_tokens: int,
                          vocab_local: int) -> str:
    """`forward_packed`'s `lm_head` for one micro-batch: "hidden" (fused log-probs) or "logits".

    mode: the run setting; specialization_allows: not `specialization.receives_logits()` (and
    no value head); on_cuda: the model's device; num_local_tokens: T_local; vocab_local: V_pad/tp.
    """
    if mode not in LM_HEAD_LOG_PROBS_MODES:
        raise ValueError(f"--lm-head-log-probs must be one of {list(LM_HEAD_LOG_PROBS_MODES)}, got {mode!r}")
    if not specialization_allows or mode == "logits":
        return "logits"
    if mode == "fused":
        return "hidden"
    large = logits_shard_bytes(num_local_tokens, vocab_local) >= AUTO_FUSED_LOGITS_BYTES
    return "hidden" if on_cuda or large else "logits"


__all__ = ["AUTO_FUSED_LOGITS_BYTES", "LM_HEAD_LOG_PROBS_MODES", "choose_lm_head_output", "logits_shard_bytes"]
