"""Aggregation modes: sum form, global counts, split invariance, padded helpers."""

import pytest
import torch

from stacx.objectives import agg_loss, aggregate_mean, aggregate_sum, count_normalizer, masked_mean, normalizer_kind

from tests.objectives.trajectories import random_lengths, random_masks

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
NORM_LEN = 8.0


def reference_loss(losses, masks, mode):
    """Independent float64 formula on the whole batch (python loops)."""
    per_seq, tokens = [], 0.0
    for loss, mask in zip(losses, masks):
        s = sum(float(l) * float(m) for l, m in zip(loss, mask))
        n = sum(float(m) for m in mask)
        tokens += n
        if n == 0:
            continue
        per_seq.append({"seq-mean-token-mean": s / n, "seq-mean-token-sum": s, "seq-mean-token-sum-norm": s / NORM_LEN,
                        "token-mean": s}[mode])
    if mode == "token-mean":
        return sum(per_seq) / tokens
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", MODES)
def test_sum_over_micro_batches_divided_by_global_count_matches_reference(mode):
    g = torch.Generator().manual_seed(1)
    lengths = random_lengths(g, 9)
    losses = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = random_masks(g, lengths)
    masks[2] = torch.zeros(lengths[2], dtype=torch.float64)  # an all-masked sequence
    reference = reference_loss(losses, masks, mode)
    # Any split into micro-batches gives the same result: sum of sums / sum of counts.
    for cut in ([9], [3, 6], [1, 1, 7], [4, 2, 3]):
        total, count, start = 0.0, 0.0, 0
        for size in cut:
            part = slice(start, start + size)
            total = total + aggregate_sum(losses[part], masks[part], mode, seq_norm_len=NORM_LEN)
            count = count + count_normalizer(masks[part], mode)
            start += size
        assert abs(float(total / count) - reference) < 1e-12
    assert normalizer_kind(mode) == ("tokens" if mode == "token-mean" else "samples")


def test_all_masked_and_empty_inputs_give_zero_not_nan():
    losses = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    masks = [torch.zeros(2), torch.zeros(1)]
    for mode in MODES:
        assert aggregate_sum(losses, masks, mode, seq_norm_len=4).item() == 0.0
        assert aggregate_mean(losses, masks, mode, seq_norm_len=4).item() == 0.0
        assert count_normalizer(masks, mode).item() == 0.0
    assert masked_mean(torch.tensor([1.0, 2.0]), torch.zeros(2)).item() == 0.0


def test_padded_agg_loss_and_masked_mean_match_unpadded():
    g = torch.Generator().manual_seed(2)
    loss = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) < 0.7).to(torch.float64)
    for mode in MODES:
        norm = 6 if mode == "seq-mean-token-sum-norm" else None
        expected = aggregate_mean(list(loss), list(mask), mode, seq_norm_len=norm)
        torch.testing.assert_close(agg_loss(loss, mask, mode), expected)
    torch.testing.assert_close(masked_mean(loss, mask), (loss * mask).sum() / mask.sum())
    torch.testing.assert_close(masked_mean(loss, mask, dim=1), (loss * mask).sum(1) / mask.sum(1).clamp_min(1e-8))


def test_bad_inputs_raise_named_errors():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'.*token-mean"):
        aggregate_sum([torch.ones(2)], [torch.ones(2)], "mean")
    with pytest.raises(ValueError, match="needs a positive seq_norm_len"):
        aggregate_sum([torch.ones(2)], [torch.ones(2)], "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"loss_masks\[1\] has length 2 but per_token_losses\[1\] has length 3"):
        aggregate_sum([torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(2)], "token-mean")
    with pytest.raises(ValueError, match="masked_mean"):
        masked_mean(torch.ones(2, 3), torch.ones(3))
