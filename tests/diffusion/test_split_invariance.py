"""Every diffusion loss gives the same gradient on 1 vs 2 data-parallel gloo ranks and for any split
into micro-batches (the one reduction contract), through the objectives the workers run."""

import pytest
import torch
from torch import nn

from stacx.diffusion.sampling import sample_trajectories
from stacx.diffusion.objective import OBJECTIVES
from stacx.diffusion.runtime import average_gradients, global_step_counts, slice_batch
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.reduction import Reducer
from stacx.testing.distributed import run_distributed

NUM, SHAPE, STEPS = 8, (3, 4, 4), 4
KINDS = ("sft", "grpo", "dpo", "nft")
PROMPTS = [f"prompt {'x' * i}" for i in range(NUM)]


class ToyVelocity(nn.Module):
    """v = w * x + b * t + c(prompt) * u: small, float64, with the model interface the losses use."""

    def __init__(self, shift: float = 0.0):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(SHAPE, generator=gen, dtype=torch.float64) * 0.3 + shift)
        self.b = nn.Parameter(torch.randn(SHAPE, generator=gen, dtype=torch.float64) + shift)
        self.u = nn.Parameter(torch.randn(SHAPE, generator=gen, dtype=torch.float64))

    def encode(self, prompts):
        return {"c": torch.tensor([len(p) / 10.0 for p in prompts], dtype=torch.float64).view(-1, 1, 1, 1)}

    def velocity(self, x, t, conditioning):
        return self.w * x + self.b * t.to(x.dtype).view(-1, 1, 1, 1) + conditioning["c"] * self.u


def config():
    return AlgorithmConfig.from_values(dict(clip_ratio_low=0.05, clip_ratio_high=0.05, use_kl_loss=True,
                                            kl_loss_coef=0.04, policy_loss="flow_grpo_clip", nft_beta=0.8,
                                            nft_advantage_clip=1.0, diffusion_dpo_beta=20.0))


def global_batch(kind):
    gen = torch.Generator().manual_seed(11)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    batch = {"prompts": PROMPTS, "noise": randn(NUM, *SHAPE), "t": torch.rand(NUM, generator=gen, dtype=torch.float64)}
    advantages = randn(NUM)
    if kind in ("sft", "nft"):
        batch["images"] = randn(NUM, *SHAPE)
    if kind == "nft":
        batch["advantages"] = advantages
    if kind == "dpo":
        batch.update(chosen=randn(NUM, *SHAPE), rejected=randn(NUM, *SHAPE))
    if kind == "grpo":
        traj = sample_trajectories(ToyVelocity(), PROMPTS, randn(NUM, *SHAPE), STEPS, eta=0.9,
                                   generator=torch.Generator().manual_seed(3))
        batch = {"prompts": PROMPTS, "latents": traj.latents, "timesteps": traj.timesteps, "sde_mask": traj.sde_mask,
                 "step_std": traj.step_std, "sigmas": traj.sigmas, "advantages": advantages,
                 # pi_old differs from pi_theta, so ratios move away from 1 and the clip engages
                 "old_log_probs": traj.log_probs + 0.1 * randn(NUM, STEPS)}
    return batch


def gradient(kind, groups, num_micro_batches):
    """(flat gradient, loss) of this rank's share of the global batch, split into micro-batches."""
    model, reference = ToyVelocity(), ToyVelocity(shift=0.05)
    objective = OBJECTIVES[kind](config())
    batch = global_batch(kind)
    per_rank = NUM // groups.dp_size
    mine = slice_batch(batch, groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    counts = global_step_counts(objective.loss_terms(mine), groups, torch.device("cpu"))
    reducer = Reducer.for_step(mode="token-mean", counts=counts, groups=groups)
    size = -(-per_rank // num_micro_batches)
    total = 0.0
    for start in range(0, per_rank, size):
        loss, _ = objective.compute_loss(model, reference, slice_batch(mine, start, min(start + size, per_rank)),
                                              reducer)
        loss.backward()
        total += reducer.loss_value(loss)
    average_gradients(model, groups)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), total


def _on_two_ranks(groups):
    return {kind: gradient(kind, groups, 2) for kind in KINDS}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_on_two_ranks, world_size=2, timeout_s=120)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_diffusion_loss_gradient_is_invariant_to_dp_ranks_and_micro_batches(kind, two_rank_results):
    single = ProcessGroups.single_process()
    reference_grad, reference_loss = gradient(kind, single, 1)
    assert reference_grad.abs().max() > 1e-4  # the baseline is not trivial
    for name, (grad, loss) in [("1 rank, 3 micro-batches", gradient(kind, single, 3)),
                               ("2 ranks x 2 micro-batches, rank 0", two_rank_results[0][kind]),
                               ("2 ranks x 2 micro-batches, rank 1", two_rank_results[1][kind])]:
        assert torch.allclose(grad, reference_grad, rtol=1e-9, atol=1e-12), name
    rank_loss = two_rank_results[0][kind][1] + two_rank_results[1][kind][1]
    assert abs(rank_loss - reference_loss) < 1e-9 * max(1.0, abs(reference_loss))
