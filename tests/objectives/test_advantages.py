"""Advantage estimators against independent float64 formulas, plus edge cases."""

import math
import statistics

import pytest
import torch

from stacx.objectives.advantages_returns import gae_returns
from stacx.objectives.registry import get_advantage, get_kl_estimator

from tests.objectives.trajectories import config, random_lengths, random_log_probs


def make_rollout(seed=0, num_prompts=3, group=4):
    g = torch.Generator().manual_seed(seed)
    n = num_prompts * group
    lengths = random_lengths(g, n)
    return {
        "rewards": torch.randint(0, 3, (n,), generator=g).to(torch.float64).tolist(),
        "prompt_id": [f"p{i // group}" for i in range(n)],
        "response_lengths": lengths,
    }


def per_trajectory_scalars(advantages, lengths):
    values = []
    for adv, n in zip(advantages, lengths):
        assert adv.shape == (n,) and adv.dtype == torch.float32
        assert torch.all(adv == adv[0]) if n else True
        values.append(float(adv[0]) if n else None)
    return values


def test_grpo_dr_grpo_rloo_reward_centered_match_group_formulas():
    rollout = make_rollout(seed=3)
    rollout["rewards"][0:4] = [1.0, 1.0, 1.0, 1.0]  # a zero-variance group
    rollout["prompt_id"].append("lonely")  # a group of one
    rollout["rewards"].append(5.0)
    rollout["response_lengths"].append(1)  # a length-1 response
    groups = {}
    for i, key in enumerate(rollout["prompt_id"]):
        groups.setdefault(key, []).append(rollout["rewards"][i])
    expected = {"grpo": [], "dr_grpo": [], "rloo": [], "reward_centered": []}
    batch_mean = statistics.fmean(rollout["rewards"])
    for i, key in enumerate(rollout["prompt_id"]):
        group, r = groups[key], rollout["rewards"][i]
        n = len(group)
        mean = statistics.fmean(group)
        std = statistics.stdev(group) if n > 1 else 0.0
        expected["grpo"].append(0.0 if n == 1 else (r - mean) / (std + 1e-6))
        expected["dr_grpo"].append(0.0 if n == 1 else r - mean)
        expected["rloo"].append(0.0 if n == 1 else r - (sum(group) - r) / (n - 1))
        expected["reward_centered"].append(r - batch_mean)
    for name, values in expected.items():
        got = per_trajectory_scalars(get_advantage(name)(config(), rollout), rollout["response_lengths"])
        for a, b in zip(got, values):
            assert math.isfinite(a) and abs(a - b) < 1e-5, (name, got, values)
    got = per_trajectory_scalars(get_advantage("grpo")(config(norm_adv_by_std=False), rollout), rollout["response_lengths"])
    assert max(abs(a - b) for a, b in zip(got, expected["dr_grpo"])) < 1e-6
    assert got[0:4] == [0.0, 0.0, 0.0, 0.0]


def token_rewards_reference(rollout, beta, log_probs, ref_log_probs, scalar):
    out = []
    for i, n in enumerate(rollout["response_lengths"]):
        r = [0.0] * n
        for t in range(n):
            r[t] -= beta * (float(log_probs[i][t]) - float(ref_log_probs[i][t]))  # k1
        r[-1] += scalar[i]
        out.append(r)
    return out


def whiten_reference(values, masks):
    flat = [v for seq, m in zip(values, masks) for v, k in zip(seq, m) if k]
    mean = statistics.fmean(flat)
    std = statistics.pstdev(flat)
    return [[(v - mean) / (std + 1e-6) * k for v, k in zip(seq, m)] for seq, m in zip(values, masks)]


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_discounted_returns_with_kl_in_reward_and_whitening(name):
    rollout = make_rollout(seed=5)
    g = torch.Generator().manual_seed(9)
    lengths = rollout["response_lengths"]
    rollout["log_probs"] = random_log_probs(g, lengths)
    rollout["ref_log_probs"] = random_log_probs(g, lengths)
    rollout["loss_masks"] = [torch.tensor([1.0] * (n - 1) + [float(i % 2)]) for i, n in enumerate(lengths)]
    cfg = config(gamma=0.9, use_kl_in_reward=True, kl_in_reward_coef=0.1)
    scalar = list(rollout["rewards"])
    if name.endswith("baseline"):
        groups = {}
        for key, r in zip(rollout["prompt_id"], scalar):
            groups.setdefault(key, []).append(r)
        scalar = [r - statistics.fmean(groups[k]) for k, r in zip(rollout["prompt_id"], scalar)]
    rewards = token_rewards_reference(rollout, 0.1, rollout["log_probs"], rollout["ref_log_probs"], scalar)
    returns = []
    for r in rewards:
        returns.append([sum(0.9 ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))])
    masks = [m.tolist() for m in rollout["loss_masks"]]
    expected = whiten_reference(returns, masks)
    got = get_advantage(name)(cfg, rollout)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, torch.tensor(b, dtype=torch.float32), rtol=1e-5, atol=1e-5)


def test_gae_matches_sum_of_discounted_deltas_and_returns():
    rollout = make_rollout(seed=7, num_prompts=2, group=3)
    g = torch.Generator().manual_seed(11)
    lengths = rollout["response_lengths"]
    rollout["values"] = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    rollout["token_rewards"] = [0.1 * torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    gamma, lam = 0.95, 0.8
    cfg = config(gamma=gamma, lam=lam)
    got, got_returns = get_advantage("gae")(cfg, rollout), gae_returns(cfg, rollout)
    for i, n in enumerate(lengths):
        v = rollout["values"][i].tolist() + [0.0]
        r = rollout["token_rewards"][i].tolist()
        r[-1] += rollout["rewards"][i]
        delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(n)]
        adv = [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
        torch.testing.assert_close(got[i], torch.tensor(adv, dtype=torch.float32), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_returns[i], torch.tensor([a + b for a, b in zip(adv, v)], dtype=torch.float32),
                                   rtol=1e-5, atol=1e-5)
    whitened = get_advantage("gae")(config(gamma=gamma, lam=lam, whiten_advantages=True), rollout)
    flat = torch.cat(whitened).double()
    assert abs(flat.mean().item()) < 1e-5 and abs(flat.std(unbiased=False).item() - 1.0) < 1e-4


def test_single_length_one_trajectory_and_kl_in_reward_estimator_choice():
    rollout = {"rewards": [2.0], "prompt_id": [0], "response_lengths": [1],
               "log_probs": [torch.tensor([-0.5])], "ref_log_probs": [torch.tensor([-1.5])]}
    for name in ("grpo", "rloo", "dr_grpo", "reward_centered", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        (adv,) = get_advantage(name)(config(), rollout)
        assert adv.shape == (1,) and torch.isfinite(adv).all() and adv.item() == 0.0, name
    rollout["values"] = [torch.tensor([0.5])]
    cfg = config(use_kl_in_reward=True, kl_in_reward_coef=0.5, kl_in_reward_type="k2")
    (adv,) = get_advantage("gae")(cfg, rollout)
    k2 = get_kl_estimator("k2")(torch.tensor([-0.5]), torch.tensor([-1.5])).item()
    assert adv.item() == pytest.approx(2.0 - 0.5 * k2 - 0.5)


def test_mismatched_inputs_raise_named_errors():
    rollout = {"rewards": [1.0, 2.0], "prompt_id": [0, 0], "response_lengths": [2, 3],
               "values": [torch.zeros(2), torch.zeros(4)]}
    with pytest.raises(ValueError, match=r"values\[1\] has length 4 but token_level_rewards\[1\] has length 3"):
        get_advantage("gae")(config(), rollout)
    with pytest.raises(ValueError, match="rewards must hold one scalar per trajectory"):
        get_advantage("grpo")(config(), {**rollout, "rewards": [1.0]})
    with pytest.raises(ValueError, match="rollout_data has no field 'values'"):
        get_advantage("gae")(config(), {k: v for k, v in rollout.items() if k != "values"})
    with pytest.raises(ValueError, match=r"token_rewards\[0\] has shape \(3,\) but response_lengths\[0\] is 2"):
        get_advantage("reinforce_plus_plus")(config(), {**rollout, "token_rewards": [torch.zeros(3), torch.zeros(3)]})


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reward_centered"])
def test_an_episode_that_branched_counts_once_in_its_groups_statistics(name):
    """An agent episode whose session branched gives several trajectories with its reward and episode id:
    the advantages are those of the episodes, each trajectory getting its episode's (branching
    three times does not weigh an episode three times in the mean and std)."""
    episodes = {"rewards": [1.0, 0.0, 0.0, 2.0], "prompt_id": [0, 0, 0, 1], "response_lengths": [3, 2, 4, 1]}
    branched = {"rewards": [1.0, 1.0, 1.0, 0.0, 0.0, 2.0], "prompt_id": [0, 0, 0, 0, 0, 1],
                "episode_id": [7, 7, 7, 8, None, 9], "response_lengths": [3, 1, 1, 2, 4, 1]}
    estimator = get_advantage(name)
    per_episode = per_trajectory_scalars(estimator(config(), episodes), episodes["response_lengths"])
    per_branch = per_trajectory_scalars(estimator(config(), branched), branched["response_lengths"])
    assert per_branch == pytest.approx([per_episode[0]] * 3 + per_episode[1:], abs=1e-6)
    assert per_episode[0] != 0.0
    without_ids = dict(branched, episode_id=None)    # counted per branch: a different baseline
    assert per_trajectory_scalars(estimator(config(), without_ids), branched["response_lengths"])[0] \
        != pytest.approx(per_episode[0], abs=1e-3)
