"""Supervised fine-tuning cross-entropy."""

from __future__ import annotations

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import register_loss
from stacx.objectives.validation import check_trajectory_lists, split_like


@register_loss("sft_cross_entropy")
def sft_cross_entropy(config: AlgorithmConfig, log_prob, loss_masks):
    """Token cross-entropy of the target tokens: l_t = -log pi(y_t).

    log_prob: list of (response_len_i,) log-probs of the target tokens (with gradients; the
    vocab-parallel log-softmax is computed by the framework). Aggregate with any mode
    (`token-mean` is the usual SFT loss). Metrics: `nll` (mask-weighted sum of -log pi).
    """
    lengths = check_trajectory_lists("log_prob", log_prob, loss_masks=loss_masks)
    if not lengths:
        raise ValueError("log_prob is empty: sft_cross_entropy needs at least one sequence")
    loss = -torch.cat(list(log_prob))
    mask = torch.cat(list(loss_masks)).detach().to(loss.dtype)
    return split_like(loss, lengths), {"nll": (loss.detach() * mask).sum()}
