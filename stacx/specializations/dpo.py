"""Direct preference optimization on (chosen, rejected) pairs against a frozen reference."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from stacx.objectives.aggregation import loss_token_counts
from stacx.objectives.registry import get_loss
from stacx.specializations.base import LossTerms, Specialization

NUM_PAIRS = "num_pairs"
DPO_METRICS = ("dpo_loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy")


def pair_up(batch: Mapping[str, Any], num_sequences: int) -> list[tuple[int, int]]:
    """(chosen index, rejected index) per pair, in order of first appearance, from the per-sequence
    fields `pair_ids` and `is_chosen`. Both halves of a pair must be in the same micro-batch."""
    for name in ("pair_ids", "is_chosen"):
        values = batch.get(name)
        if values is None:
            raise ValueError(f"batch field {name!r} is missing (DPO needs one entry per sequence)")
        if len(values) != num_sequences:
            raise ValueError(f"batch field {name!r} has {len(values)} entries, the micro-batch has {num_sequences} sequences")
    halves: dict[int, dict[bool, int]] = {}
    for index, (pair, chosen) in enumerate(zip(batch["pair_ids"], batch["is_chosen"])):
        pair, chosen = int(pair), bool(chosen)
        slot = halves.setdefault(pair, {})
        if chosen in slot:
            kind = "chosen" if chosen else "rejected"
            raise ValueError(f"batch field 'pair_ids': pair {pair} has two {kind} sequences ({slot[chosen]} and {index})")
        slot[chosen] = index
    pairs = []
    for pair, slot in halves.items():
        if len(slot) != 2:
            raise ValueError(
                f"batch field 'pair_ids': pair {pair} has only its {'chosen' if True in slot else 'rejected'} "
                "sequence in this micro-batch; pack chosen and rejected together"
            )
        pairs.append((slot[True], slot[False]))
    return pairs


class DPOSpecialization(Specialization):
    """Direct preference optimization on (chosen, rejected) pairs against a frozen reference.

    Per pair: h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) with sequence
    log-probs summed over response tokens; sigmoid loss -log sigmoid(beta h) or IPO
    (h - 1/(2 beta))^2 (config dpo_loss_type, dpo_beta, label_smoothing; objective `dpo`).

    Batch: `loss_masks`, `ref_log_probs` (from the dataset, or computed by the in-worker
    reference through `compute_log_probs` when absent: needs_reference() is True), and the
    per-sequence `pair_ids` / `is_chosen`; both halves of a pair in the same micro-batch and
    every response with at least one loss token. Sequence-level: whole responses are gathered
    (one CP all-gather when cp > 1). The mean over the step's pairs comes from the Reducer in
    mode seq-mean-token-sum: each pair's loss is placed on both of its sequences, and N_seq = 2
    x pairs. Metrics (sums over pairs, logged per pair): dpo_loss, chosen_reward,
    rejected_reward, reward_margin, reward_accuracy.
    """

    base_required_fields = ("ref_log_probs",)
    metric_denominators = {name: NUM_PAIRS for name in DPO_METRICS}
    reads_preference_pairs = True

    def needs_reference(self) -> bool:
        return True

    def needs_whole_sequences(self) -> bool:
        return True  # sequence-level: one CP all-gather when cp > 1

    def loss_agg_mode(self) -> str:
        return "seq-mean-token-sum"

    def check_fields(self, batch) -> None:
        pair_up(batch, len(batch.layout.lengths))
        for index, count in enumerate(loss_token_counts(batch.loss_masks).tolist()):
            if count == 0:
                raise ValueError(f"batch field 'loss_masks': sample {index} has no loss token; DPO needs one per response")

    def per_token_terms(self, view, batch) -> LossTerms:
        pairs = pair_up(batch, len(view.values))
        log_probs, masks, ref = view.values, view.loss_masks, view.cut(batch.ref_log_probs)
        chosen, rejected = [c for c, _ in pairs], [r for _, r in pairs]
        pick = lambda values, indices: [values[i] for i in indices]  # noqa: E731
        pair_losses, metrics = get_loss("dpo")(
            self.config, pick(log_probs, chosen), pick(log_probs, rejected), pick(ref, chosen), pick(ref, rejected),
            pick(masks, chosen), pick(masks, rejected),
        )
        # Each pair's loss is placed on both of its sequences, each counted as one token: N_seq = 2 x pairs.
        per_sequence = [None] * len(view.values)
        for pair_loss, (c, r) in zip(pair_losses, pairs):
            per_sequence[c] = per_sequence[r] = pair_loss.reshape(1)
        ones = [torch.ones(1, dtype=pair_losses.dtype, device=pair_losses.device) for _ in per_sequence]
        metrics[NUM_PAIRS] = torch.tensor(float(len(pairs)), dtype=torch.float64)
        return LossTerms(per_sequence, metrics, masks=ones, sequence_token_counts=[1] * len(per_sequence))
