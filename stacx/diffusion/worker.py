"""What the policy role's Ray workers run for a diffusion recipe: functions `fn(worker, ...)` shipped
with `RoleWorkers.execute_all` / `execute_per_rank` (the same workers and process groups as the
LLM roles: gloo on CPU, NCCL on GPU). The model is replicated on every data-parallel rank; each rank
samples and trains on its share of the batch, gradients are averaged over the DP group in one
all-reduce per parameter tensor, and metric sums in one all-reduce.

State kept in `worker.state`: `policy` (DiffusionModel), `reference` (frozen, when the recipe needs
one), `optimizer`, `specialization`, `rollout` (this rank's last sampled trajectories).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.distributed as dist

from stacx.diffusion.rewards import get_image_reward
from stacx.diffusion.sampling import group_noise, sample_ode, sample_trajectories, sde_window
from stacx.parallel.collectives import all_reduce_sum_
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.reduction import Reducer, StepCounts, count_loss_tokens


def _groups(worker) -> ProcessGroups:
    return worker.groups if worker.groups is not None else ProcessGroups.single_process()


def _device() -> torch.device:
    """The rank's GPU (Ray narrows CUDA_VISIBLE_DEVICES to it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def build_policy(worker, *, model_source: Any, reference_path: str | None, specialization_cls, config, settings,
                 lr: float, weight_decay: float, clip_grad: float, seed: int) -> dict:
    """Build (or load) the policy, its optimizer and, when needed, the frozen reference.

    `model_source`: a checkpoint folder (diffusers layout) or a DiffusionModelConfig. The seed is
    the same on every rank, so replicas start identical. Without `reference_path` the reference is
    a frozen copy of the initial policy.
    """
    from stacx.diffusion.checkpoint import load_diffusion_model
    from stacx.diffusion.config import DiffusionModelConfig
    from stacx.diffusion.models import DiffusionModel

    torch.manual_seed(seed)
    if isinstance(model_source, DiffusionModelConfig):
        policy = DiffusionModel(model_source)
    else:
        policy = load_diffusion_model(model_source)
    policy = policy.to(_device())
    specialization = specialization_cls(config, _groups(worker))
    reference = None
    if specialization.uses_reference():
        reference = load_diffusion_model(reference_path).to(_device()) if reference_path else copy.deepcopy(policy)
        reference.requires_grad_(False)
    worker.state.update(
        policy=policy, reference=reference, specialization=specialization, settings=settings,
        optimizer=torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay), clip_grad=clip_grad)
    return {"num_parameters": sum(p.numel() for p in policy.parameters()), "has_reference": reference is not None}


def sample_group_rollouts(worker, prompts: Sequence[str], group_size: int, step: int, seed: int,
                          reward_name: str) -> dict:
    """Sample `group_size` images per prompt with the SDE sampler, score them; keep the trajectories.

    Returns {"rewards": [B] list} (B = len(prompts) * group_size, prompt-major)."""
    settings = worker.state["settings"]
    policy = worker.state["policy"]
    generator = torch.Generator().manual_seed(seed)
    shape = policy.config.latent_shape
    if settings.shared_group_noise:
        noise = group_noise(len(prompts), group_size, shape, generator)
    else:
        noise = torch.randn((len(prompts) * group_size, *shape), generator=generator)
    noise = noise.to(policy.device)
    expanded = [p for p in prompts for _ in range(group_size)]
    mask = None
    if settings.sde_window_size:
        mask = sde_window(step, settings.num_inference_steps, settings.sde_window_size,
                          shift_every=settings.sde_window_shift_every, stride=settings.sde_window_stride)
    if settings.kind == "nft":  # forward-process RL: any solver; the clean images are all it needs
        images = sample_ode(policy, expanded, noise, settings.num_inference_steps)
        rollout = {"prompts": expanded, "images": images}
    else:
        trajectories = sample_trajectories(policy, expanded, noise, settings.num_inference_steps,
                                           eta=settings.sde_eta, sigma_schedule=settings.sde_sigma_schedule,
                                           sde_mask=mask, generator=generator)
        images = trajectories.images
        rollout = {"prompts": expanded, "images": images, "latents": trajectories.latents,
                   "old_log_probs": trajectories.log_probs, "timesteps": trajectories.timesteps,
                   "sde_mask": trajectories.sde_mask, "step_std": trajectories.step_std,
                   "sigmas": trajectories.sigmas}
    rewards = get_image_reward(reward_name)(images.cpu(), expanded)
    worker.state["rollout"] = rollout
    return {"rewards": rewards.tolist()}


def rollout_batch(worker, advantages: Sequence[float], forward_noise: dict | None = None) -> dict:
    """This rank's training batch from its kept rollout and the advantages the driver computed."""
    batch = dict(worker.state["rollout"])
    batch["advantages"] = torch.tensor(list(advantages), dtype=torch.float32)
    if forward_noise is not None:
        batch.update(forward_noise)
    return batch


def train_on_batch(worker, batch: dict, micro_batch_size: int) -> dict:
    """One optimizer step on this rank's `batch` (a dict of per-sample tensors / lists, shared
    fields like `timesteps` kept whole), split into micro-batches; returns reduced metrics."""
    groups = _groups(worker)
    specialization = worker.state["specialization"]
    policy, reference = worker.state["policy"], worker.state["reference"]
    optimizer = worker.state["optimizer"]
    counts = _global_step_counts(specialization.loss_terms(batch), groups, policy.device)
    reducer = Reducer.for_step(mode="token-mean", counts=counts, groups=groups)
    num = len(batch["prompts"])
    batch = _to_device(batch, policy.device)
    optimizer.zero_grad(set_to_none=True)
    loss_value = 0.0
    metric_sums: dict[str, torch.Tensor] = {}
    for start in range(0, num, micro_batch_size):
        micro = _slice_batch(batch, start, min(start + micro_batch_size, num))
        loss, metrics = specialization.compute_loss(policy, reference, micro, reducer)
        loss.backward()
        loss_value += reducer.loss_value(loss)
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value.detach().double().to(policy.device)
    _average_gradients(policy, groups)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), worker.state["clip_grad"])
    optimizer.step()
    names = sorted(metric_sums)
    totals = torch.stack([torch.as_tensor(metric_sums[n], dtype=torch.float64, device=policy.device) for n in names]
                         + [torch.tensor(loss_value, dtype=torch.float64, device=policy.device)])
    all_reduce_sum_(totals, groups.dp)  # ONE all-reduce of every metric sum and the loss
    result = {name: float(totals[i]) / max(counts.num_tokens, 1) for i, name in enumerate(names)}
    result.update(loss=float(totals[-1]), grad_norm=float(grad_norm), num_loss_terms=counts.num_tokens)
    return result


def _global_step_counts(loss_terms, groups: ProcessGroups, device: torch.device) -> StepCounts:
    """StepCounts over the DP group, one all-reduce of two numbers on the rank's device (NCCL takes
    only GPU tensors); loss terms counted by `count_loss_tokens`, the one Stacx convention."""
    local = torch.tensor(count_loss_tokens(loss_terms), dtype=torch.float64, device=device)
    total = all_reduce_sum_(local, groups.dp)
    return StepCounts(num_tokens=int(total[0]), num_sequences=int(total[1]))


def _slice_batch(batch: dict, start: int, end: int) -> dict:
    shared = {"timesteps", "sde_mask", "step_std", "sigmas"}
    out = {}
    for key, value in batch.items():
        out[key] = value if key in shared else value[start:end]
    return out


def _average_gradients(model: torch.nn.Module, groups: ProcessGroups) -> None:
    """DDP's averaging: sum over DP, divided by dp (the Reducer's gradient_scale undoes the 1/dp)."""
    if groups.dp_size == 1:
        return
    for parameter in model.parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM, group=groups.dp)
        parameter.grad.div_(groups.dp_size)


def evaluate_prompts(worker, prompts: Sequence[str], seed: int, reward_name: str, num_steps: int) -> dict:
    """ODE samples of `prompts` from fixed noise (the same every call) and their rewards."""
    policy = worker.state["policy"]
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(prompts), *policy.config.latent_shape), generator=generator).to(policy.device)
    images = sample_ode(policy, list(prompts), noise, num_steps).cpu()
    return {"rewards": get_image_reward(reward_name)(images, list(prompts)).tolist(), "images": images}


def save_policy(worker, path: str) -> str | None:
    """Rank 0 writes the policy in the diffusers layout; other ranks do nothing."""
    from stacx.diffusion.checkpoint import save_diffusion_model

    if worker.rank != 0:
        return None
    return save_diffusion_model(worker.state["policy"], path)  # safetensors and save_pretrained copy to CPU


def parameter_checksum(worker) -> float:
    """Sum of every parameter (tests check replicas stay identical)."""
    return float(sum(p.detach().double().sum() for p in worker.state["policy"].parameters()))


def train_on_rollout(worker, advantages: Sequence[float], forward_noise: dict | None, micro_batch_size: int) -> dict:
    """One optimizer step on this rank's kept rollout (see `rollout_batch`, `train_on_batch`)."""
    return train_on_batch(worker, rollout_batch(worker, advantages, forward_noise), micro_batch_size)
