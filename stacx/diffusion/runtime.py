"""`DiffusionRuntime`: one rank of a diffusion recipe's policy role (the workload's per-rank runtime,
what `DiffusionPolicyGroup` builds on each Ray worker; the LLM roles' equivalent is `RoleRuntime`).

The model is replicated on every data-parallel rank (the same seed everywhere, so replicas start
identical); each rank samples and trains on its share of the batch, gradients are averaged over the
DP group in one all-reduce per parameter tensor (gloo on CPU, NCCL on GPU), and metric sums in one
all-reduce. The runtime keeps the policy (`DiffusionModel`), the frozen reference when the objective
needs one, the optimizer, the objective and this rank's last sampled trajectories.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.distributed as dist

from stacx.diffusion.algorithm_config import DiffusionAlgorithmConfig
from stacx.diffusion.checkpoint import load_diffusion_config, load_diffusion_model, save_diffusion_model
from stacx.diffusion.config import DiffusionModelConfig
from stacx.diffusion.models import DiffusionModel
from stacx.diffusion.prompts import ALL_PROMPTS, VOCABULARY
from stacx.diffusion.rewards import get_image_reward
from stacx.diffusion.sampling import group_noise, sample_ode, sample_trajectories, sde_window
from stacx.parallel.collectives import all_reduce_sum_
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.reduction import Reducer, StepCounts, count_loss_tokens
from stacx.trainer.config.recipe import ModelRole
from stacx.trainer.config.run import RunConfig

SHARED_BATCH_FIELDS = frozenset({"timesteps", "sde_mask", "step_std", "sigmas"})
"""Batch fields common to every sample (the time grid and its per-step values), kept whole when a batch is sliced."""


def model_source(hf_checkpoint: str | None, algorithm: DiffusionAlgorithmConfig) -> str | DiffusionModelConfig:
    """The checkpoint folder of --hf-checkpoint (its config read now: a bad folder fails early, named),
    or a fresh model config from the algorithm's model fields."""
    if hf_checkpoint:
        load_diffusion_config(hf_checkpoint)
        return hf_checkpoint
    label = algorithm.model_family == "dit"
    return DiffusionModelConfig(family=algorithm.model_family, conditioner="label" if label else "text",
                                image_size=algorithm.image_size, num_layers=algorithm.num_layers,
                                vocabulary=ALL_PROMPTS if label else VOCABULARY)


def latent_shape(source: str | DiffusionModelConfig) -> tuple[int, ...]:
    """(C, H, W) of the model `source` names."""
    config = source if isinstance(source, DiffusionModelConfig) else load_diffusion_config(source)
    return tuple(config.latent_shape)


def _device() -> torch.device:
    """The rank's GPU (Ray narrows CUDA_VISIBLE_DEVICES to it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class DiffusionRuntime:
    """One rank of the policy role of a diffusion recipe."""

    def __init__(self, role: ModelRole, run_config: RunConfig, algorithm: DiffusionAlgorithmConfig,
                 groups: ProcessGroups | None, *, rank: int = 0):
        """Build (or load) the policy, its optimizer and, when the objective needs one, the frozen reference
        (`--ref-load` through the role's `reference_checkpoint_arg`, else a copy of the initial policy)."""
        self.rank = rank
        self.groups = groups if groups is not None else ProcessGroups.single_process()
        self.algorithm = algorithm
        torch.manual_seed(run_config.train.seed)
        source = model_source(run_config.model.hf_checkpoint, algorithm)
        policy = DiffusionModel(source) if isinstance(source, DiffusionModelConfig) else load_diffusion_model(source)
        self.policy = policy.to(_device())
        self.objective = role.specialization_cls(algorithm)
        reference_path = (getattr(run_config.model, role.reference_checkpoint_arg)
                          if role.reference_checkpoint_arg else None)
        self.reference = None
        if self.objective.uses_reference():
            self.reference = (load_diffusion_model(reference_path).to(_device()) if reference_path
                              else copy.deepcopy(self.policy))
            self.reference.requires_grad_(False)
        optim = run_config.optim
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        self.clip_grad = optim.clip_grad
        self.rollout: dict[str, Any] | None = None
        """This rank's last sampled trajectories (`sample_group_rollouts`), trained on by `train_on_rollout`."""

    def describe(self) -> dict[str, Any]:
        return {"num_parameters": sum(p.numel() for p in self.policy.parameters()),
                "has_reference": self.reference is not None}

    # ---- rollouts ------------------------------------------------------------------------------
    def sample_group_rollouts(self, prompts: Sequence[str], group_size: int, step: int, seed: int) -> list[float]:
        """Sample `group_size` images per prompt (the SDE sampler; the ODE one for `nft`), score them with
        the algorithm's `image_reward` and keep the trajectories. Returns the rewards (prompt-major)."""
        a = self.algorithm
        generator = torch.Generator().manual_seed(seed)
        shape = self.policy.config.latent_shape
        if a.shared_group_noise:
            noise = group_noise(len(prompts), group_size, shape, generator)
        else:
            noise = torch.randn((len(prompts) * group_size, *shape), generator=generator)
        noise = noise.to(self.policy.device)
        expanded = [p for p in prompts for _ in range(group_size)]
        mask = None
        if a.sde_window_size:
            mask = sde_window(step, a.num_inference_steps, a.sde_window_size, shift_every=a.sde_window_shift_every,
                              stride=a.sde_window_stride)
        if self.objective.kind == "nft":  # forward-process RL: any solver; the clean images are all it needs
            images = sample_ode(self.policy, expanded, noise, a.num_inference_steps)
            self.rollout = {"prompts": expanded, "images": images}
        else:
            trajectories = sample_trajectories(self.policy, expanded, noise, a.num_inference_steps, eta=a.sde_eta,
                                               sigma_schedule=a.sde_sigma_schedule, sde_mask=mask, generator=generator)
            images = trajectories.images
            self.rollout = {"prompts": expanded, "images": images, "latents": trajectories.latents,
                            "old_log_probs": trajectories.log_probs, "timesteps": trajectories.timesteps,
                            "sde_mask": trajectories.sde_mask, "step_std": trajectories.step_std,
                            "sigmas": trajectories.sigmas}
        return get_image_reward(a.image_reward)(images.cpu(), expanded).tolist()

    # ---- training ------------------------------------------------------------------------------
    def train_on_rollout(self, advantages: Sequence[float], forward_noise: dict | None) -> dict[str, float]:
        """One optimizer step on this rank's kept rollout with the advantages the driver computed
        (and, for `nft`, the forward-process t and eps it drew)."""
        if self.rollout is None:
            raise RuntimeError(f"rank {self.rank}: train_on_rollout before sample_group_rollouts")
        batch = dict(self.rollout)
        batch["advantages"] = torch.tensor(list(advantages), dtype=torch.float32)
        if forward_noise is not None:
            batch.update(forward_noise)
        return self.train_on_batch(batch)

    def train_on_batch(self, batch: dict) -> dict[str, float]:
        """One optimizer step on this rank's `batch` (per-sample tensors / lists, `SHARED_BATCH_FIELDS`
        kept whole), in micro-batches of the algorithm's `micro_batch_size`; returns reduced metrics."""
        groups, objective, device = self.groups, self.objective, self.policy.device
        counts = global_step_counts(objective.loss_terms(batch), groups, device)
        reducer = Reducer.for_step(mode="token-mean", counts=counts, groups=groups)
        num = len(batch["prompts"])
        batch = _to_device(batch, device)
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        metric_sums: dict[str, torch.Tensor] = {}
        size = self.algorithm.micro_batch_size
        for start in range(0, num, size):
            micro = slice_batch(batch, start, min(start + size, num))
            loss, metrics = objective.compute_loss(self.policy, self.reference, micro, reducer)
            loss.backward()
            loss_value += reducer.loss_value(loss)
            for name, value in metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + value.detach().double().to(device)
        average_gradients(self.policy, groups)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.clip_grad)
        self.optimizer.step()
        names = sorted(metric_sums)
        totals = torch.stack([torch.as_tensor(metric_sums[n], dtype=torch.float64, device=device) for n in names]
                             + [torch.tensor(loss_value, dtype=torch.float64, device=device)])
        all_reduce_sum_(totals, groups.dp)  # ONE all-reduce of every metric sum and the loss
        result = {name: float(totals[i]) / max(counts.num_tokens, 1) for i, name in enumerate(names)}
        result.update(loss=float(totals[-1]), grad_norm=float(grad_norm), num_loss_terms=counts.num_tokens)
        return result

    # ---- evaluation and checkpoints ------------------------------------------------------------
    def evaluate_prompts(self, prompts: Sequence[str], seed: int, num_steps: int) -> dict:
        """ODE samples of `prompts` from fixed noise (the same every call) and their `image_reward`s."""
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(prompts), *self.policy.config.latent_shape), generator=generator)
        images = sample_ode(self.policy, list(prompts), noise.to(self.policy.device), num_steps).cpu()
        return {"rewards": get_image_reward(self.algorithm.image_reward)(images, list(prompts)).tolist(),
                "images": images}

    def save_policy(self, path: str) -> str | None:
        """Rank 0 writes the policy in the diffusers layout; other ranks do nothing."""
        if self.rank != 0:
            return None
        return save_diffusion_model(self.policy, path)  # safetensors and save_pretrained copy to CPU

    def parameter_checksum(self) -> float:
        """Sum of every parameter (tests check replicas stay identical)."""
        return float(sum(p.detach().double().sum() for p in self.policy.parameters()))


def global_step_counts(loss_terms, groups: ProcessGroups, device: torch.device) -> StepCounts:
    """StepCounts over the DP group, one all-reduce of two numbers on the rank's device (NCCL takes
    only GPU tensors); loss terms counted by `count_loss_tokens`, the one Stacx convention."""
    local = torch.tensor(count_loss_tokens(loss_terms), dtype=torch.float64, device=device)
    total = all_reduce_sum_(local, groups.dp)
    return StepCounts(num_tokens=int(total[0]), num_sequences=int(total[1]))


def slice_batch(batch: dict, start: int, end: int) -> dict:
    """Samples [start, end) of `batch`; `SHARED_BATCH_FIELDS` kept whole."""
    return {key: value if key in SHARED_BATCH_FIELDS else value[start:end] for key, value in batch.items()}


def average_gradients(model: torch.nn.Module, groups: ProcessGroups) -> None:
    """DDP's averaging: sum over DP, divided by dp (the Reducer's gradient_scale undoes the 1/dp)."""
    if groups.dp_size == 1:
        return
    for parameter in model.parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM, group=groups.dp)
        parameter.grad.div_(groups.dp_size)
