"""The example under examples/custom_specialization: loaded like --custom-module, its recipe
registered, and its specialization trains a tiny megatron-core model for a few steps on two
tensor-parallel ranks with a plain loop (forward, compute_loss, backward, optimizer step)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from stacx.testing.distributed import run_distributed

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_specialization",
                       "reward_weighted_sft.py")
VOCAB, NUM_STEPS, GROUP_SIZE = 53, 6, 4


def load_example():
    from stacx.objectives import load_custom_modules

    (module,) = load_custom_modules([os.path.realpath(EXAMPLE)])
    return module


def rollout_batch(seed: int = 4):
    """Two prompts x four sampled responses; reward = fraction of response tokens below VOCAB // 2."""
    gen = torch.Generator().manual_seed(seed)
    sequences, response_lengths, rewards, prompt_ids = [], [], [], []
    for prompt_id in range(2):
        prompt = torch.randint(0, VOCAB, (3,), generator=gen)
        for _ in range(GROUP_SIZE):
            response = torch.randint(0, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
            sequences.append(torch.cat([prompt, response]))
            response_lengths.append(response.shape[0])
            rewards.append(float((response < VOCAB // 2).float().mean()))
            prompt_ids.append(prompt_id)
    return sequences, response_lengths, rewards, prompt_ids


def train_with_the_example(groups, checkpoint: str):
    """Spawned on each rank: the recipe's specialization, a plain loop, Adam on every parameter."""
    from stacx.models import build_model, forward_packed, load_hf_checkpoint
    from stacx.objectives import get_advantage
    from stacx.parallel.metrics_allreduce import all_reduce_metric_sums
    from stacx.parallel.reduction import Reducer, compute_step_counts
    from stacx.specializations import model_inputs, pack_micro_batch
    from stacx.trainer.recipes import get_recipe
    from stacx.trainer.config.run import AlgorithmConfig

    load_example()
    training_config = get_recipe("reward_weighted_sft")
    config = AlgorithmConfig.from_values({**training_config.algorithm.to_dict(), "rwr_temperature": 0.5})
    specialization = training_config.role("policy").specialization_cls(config, groups)

    torch.manual_seed(0)
    model = build_model(checkpoint, groups, initialize_weights=False)
    load_hf_checkpoint(model, checkpoint, groups)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    sequences, response_lengths, rewards, prompt_ids = rollout_batch()
    advantages = get_advantage(config.advantage_estimator)(
        config, {"rewards": rewards, "prompt_id": prompt_ids, "response_lengths": response_lengths}
    )
    masks = [torch.ones(n) for n in response_lengths]
    batch = pack_micro_batch(sequences, response_lengths, groups=groups, loss_masks=masks, advantages=advantages)
    history = []
    for _ in range(NUM_STEPS):
        optimizer.zero_grad(set_to_none=True)
        counts = compute_step_counts(batch["loss_masks"], groups.dp)
        reducer = Reducer.for_step(mode=specialization.loss_agg_mode(), counts=counts, groups=groups)
        logits = forward_packed(model, *model_inputs(batch), groups)
        loss, metric_sums = specialization.compute_loss(logits, batch, reducer)
        loss.backward()
        optimizer.step()
        metrics = specialization.metric_means(all_reduce_metric_sums(metric_sums, groups.dp_cp))
        sequence_log_probs = [float(lp.sum()) for lp in specialization.compute_log_probs(logits.detach(), batch)]
        history.append(dict(loss=reducer.loss_value(loss), metrics=metrics, sequence_log_probs=sequence_log_probs))
    return dict(history=history, advantages=[float(a[0]) for a in advantages])


@pytest.fixture
def example_module():
    """The example loaded in this process; unregistered afterwards so that other tests (the
    recipe catalog page) see only the built-in recipes."""
    from stacx.trainer.recipes import TRAINING_CONFIGS

    module = load_example()
    yield module
    TRAINING_CONFIGS.pop("reward_weighted_sft", None)
    sys.modules.pop(module.__name__, None)


def test_the_example_recipe_is_registered_with_its_specialization(example_module):
    from stacx.trainer.recipes import get_recipe

    module = example_module
    recipe = get_recipe("reward_weighted_sft")
    assert recipe.role("policy").specialization_cls is module.RewardWeightedSFTSpecialization
    assert recipe.algorithm.advantage_estimator == "grpo"
    assert load_example() is module  # loading the file again registers nothing twice


@pytest.mark.distributed
@pytest.mark.slow
def test_the_example_specialization_trains_a_tiny_model_on_two_tensor_parallel_ranks(tmp_path):
    from stacx.models.testing import save_tiny_hf_checkpoint

    save_tiny_hf_checkpoint(str(tmp_path), "qwen2", seed=1, vocab_size=VOCAB)
    ranks = run_distributed(train_with_the_example, 2, tensor_model_parallel_size=2, args=(str(tmp_path),), timeout_s=300)
    history, advantages = ranks[0]["history"], ranks[0]["advantages"]
    assert [h["loss"] for h in ranks[1]["history"]] == [h["loss"] for h in history]  # TP ranks agree
    losses = [h["loss"] for h in history]
    assert losses[-1] < losses[0] - 0.5, losses  # the weighted NLL falls
    assert history[0]["metrics"]["num_loss_tokens"] == sum(rollout_batch()[1])
    assert 0 < history[0]["metrics"]["mean_weight"] <= 5.0
    # Reward weighting: the best response of each group gains more log-likelihood than the worst.
    gains = [after - before for before, after in zip(history[0]["sequence_log_probs"], history[-1]["sequence_log_probs"])]
    for group in range(2):
        members = range(group * GROUP_SIZE, (group + 1) * GROUP_SIZE)
        best = max(members, key=lambda i: advantages[i])
        worst = min(members, key=lambda i: advantages[i])
        assert gains[best] > gains[worst], (group, gains, advantages)
