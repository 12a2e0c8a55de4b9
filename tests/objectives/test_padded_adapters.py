"""Padded-style plugins run unchanged under the per-trajectory interface."""

import pathlib

import pytest
import torch

from stacx.objectives import aggregate_sum, count_normalizer, load_custom_modules
from stacx.objectives.adapters import adapt_padded_policy_loss
from stacx.objectives.padding import pad_trajectories
from stacx.objectives.registry import get_advantage, get_policy_loss

from tests.objectives.trajectories import config, random_lengths, random_log_probs, random_masks

# Loaded the way a user's `--custom-module padded_plugin.py` is; its names are then registered.
(PLUGIN,) = load_custom_modules([str(pathlib.Path(__file__).with_name("padded_plugin.py"))])
clip_loss, per_token_loss, seq_mean_loss = PLUGIN.clip_loss, PLUGIN.per_token_loss, PLUGIN.seq_mean_loss


def batch(seed=0, num=6):
    g = torch.Generator().manual_seed(seed)
    lengths = random_lengths(g, num, low=1, high=6)
    old = random_log_probs(g, lengths)
    new = [(o + 0.4 * torch.randn(o.shape, generator=g, dtype=torch.float64)).requires_grad_() for o in old]
    adv = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = random_masks(g, lengths)
    return lengths, old, new, adv, masks


def framework_loss(name, cfg, old, new, adv, masks, mode, cuts):
    """What the framework does: per-token losses -> sums per micro-batch / global count."""
    fn = get_policy_loss(name)
    total, start = 0.0, 0
    for size in cuts:
        part = slice(start, start + size)
        per_token, _ = fn(cfg, old[part], new[part], adv[part], masks[part])
        total = total + aggregate_sum(per_token, masks[part], mode)
        start += size
    return total / count_normalizer(masks, mode)


@pytest.mark.parametrize("name,plugin,mode", [
    ("padded_clip_loss", clip_loss, "token-mean"),
    ("padded_seq_mean_loss", seq_mean_loss, "seq-mean-token-mean"),
])
def test_scalar_plugin_loss_and_gradient_match_the_plugin_on_the_whole_batch(name, plugin, mode):
    lengths, old, new, adv, masks = batch()
    padded = [pad_trajectories(x) for x in (old, new, adv, masks)]
    expected = plugin(*padded, **({"clip_ratio": 0.2} if name == "padded_clip_loss" else {}))[0]
    expected_grad = torch.autograd.grad(expected, new)
    cfg = config(clip_ratio=0.2, loss_agg_mode=mode)
    for cuts in ([6], [2, 4], [1, 2, 3]):  # the plugin normalizes locally; the adapter restores the sum
        loss = framework_loss(name, cfg, old, new, adv, masks, mode, cuts)
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
        for a, b in zip(torch.autograd.grad(loss, new), expected_grad):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_scalar_plugin_metrics_become_sums_and_hyperparameters_come_from_config():
    lengths, old, new, adv, masks = batch(seed=1)
    fn = get_policy_loss("padded_clip_loss")
    _, metrics = fn(config(clip_ratio=0.05), old, new, adv, masks)
    padded = [pad_trajectories(x) for x in (old, new, adv, masks)]
    _, direct = clip_loss(*padded, clip_ratio=0.05)
    tokens = float(sum(m.sum() for m in masks))
    for key in ("loss", "ratio_mean", "clip_frac"):
        assert metrics[key].item() == pytest.approx(direct[key] * tokens)
    assert direct["clip_frac"] > 0
    with pytest.raises(ValueError, match="aggregates with 'token-mean' but loss_agg_mode is 'seq-mean-token-sum'"):
        fn(config(loss_agg_mode="seq-mean-token-sum"), old, new, adv, masks)


def test_per_token_plugin_is_unpadded_exactly_and_gets_padded_entropy():
    lengths, old, new, adv, masks = batch(seed=2)
    g = torch.Generator().manual_seed(3)
    entropy = [torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    per_token, metrics = get_policy_loss("padded_per_token_loss")(
        config(entropy_coef=0.1), old, new, adv, masks, entropy=entropy, raw_loss_masks=masks)
    for i in range(len(lengths)):
        torch.testing.assert_close(per_token[i], (-adv[i] * new[i] - 0.1 * entropy[i]) * masks[i])
    assert metrics["entropy"].item() == pytest.approx(float(sum((h * m).sum() for h, m in zip(entropy, masks))))
    padded = [pad_trajectories(x) for x in (old, new, adv, masks)]
    direct, _ = per_token_loss(*padded, entropy_coef=0.1, entropy=pad_trajectories(entropy))
    assert direct.shape == (len(lengths), max(lengths))


def test_padded_advantage_plugin_gets_last_token_rewards_and_is_unpadded():
    rollout = {"rewards": [1.0, 0.0, 2.0, 5.0], "prompt_id": [0, 0, 1, 1], "response_lengths": [3, 1, 2, 4]}
    advantages = get_advantage("padded_centered_advantage")(config(gamma=1.0), rollout)
    mean = sum(rollout["rewards"]) / 4
    for adv, r, n in zip(advantages, rollout["rewards"], rollout["response_lengths"]):
        torch.testing.assert_close(adv, torch.full((n,), r - mean))
    rollout["loss_masks"] = [torch.tensor([1.0, 0.0, 1.0]), torch.ones(1), torch.ones(2), torch.tensor([1.0, 1.0, 1.0, 0.0])]
    advantages = get_advantage("padded_centered_advantage")(config(), rollout)
    # the last-token reward of trajectory 3 is masked out by the plugin itself
    sums = [1.0, 0.0, 2.0, 0.0]
    for adv, s, m in zip(advantages, sums, rollout["loss_masks"]):
        torch.testing.assert_close(adv, (s - sum(sums) / 4) * m)


def test_adapter_rejects_bad_plugins():
    with pytest.raises(ValueError, match="must take \\(old_log_prob, log_prob, advantages, response_mask"):
        adapt_padded_policy_loss(lambda a, b: None)
    with pytest.raises(ValueError, match="not supported for padded plugins"):
        adapt_padded_policy_loss(clip_loss, aggregation="seq-mean-token-sum-norm")
    bad = adapt_padded_policy_loss(lambda o, n, a, m: (n[:, :1], {}))
    lengths, old, new, adv, masks = batch(seed=4)
    with pytest.raises(ValueError, match="returned shape"):
        bad(config(), old, new, adv, masks)
