"""Samplers over the flow's time grid t_0 = 1 > t_1 > ... > t_K = 0 (t = 1: noise).

- `sample_ode`: Euler steps x_{k+1} = x_k + v_theta(x_k, t_k) (t_{k+1} - t_k).
- `sample_trajectories`: the same grid with some steps replaced by the SDE step of the ODE-to-SDE
  conversion (`stacx.objectives.diffusion_loss.sde_step_mean`), recording every latent, each SDE
  step's log-probability, std and timestep. Which steps are SDE steps is a boolean mask:
  all of them for Flow-GRPO and DanceGRPO, MixGRPO's sliding window (`sde_window`) otherwise;
  losses use the SDE steps only (an ODE step has no density).
- `group_noise`: one initial noise per prompt, shared by the prompt's group of samples.

At eta = 0 every sigma_t is 0, no step is stochastic and `sample_trajectories` is `sample_ode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from stacx.objectives.diffusion_loss import SIGMA_SCHEDULES, sde_step_log_prob, sde_step_mean, sde_step_std


def time_grid(num_steps: int) -> torch.Tensor:
    """[K + 1] float64: t_k = 1 - k / K."""
    if num_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_steps}")
    return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)


def step_sigmas(grid: torch.Tensor, eta: float, schedule: str) -> torch.Tensor:
    """[K] sigma_t of each step's start time under `schedule` ('flow_grpo' or 'dance_grpo').

    Flow-GRPO's sigma_t = eta sqrt(t / (1 - t)) is infinite at t = 1: like its reference code the
    first step uses t_1 (the largest time below 1) inside the ratio. The last step (to t = 0) is
    always deterministic: its mean is the final image.
    """
    if schedule not in SIGMA_SCHEDULES:
        raise ValueError(f"sde_sigma_schedule {schedule!r} is unknown; known: {', '.join(SIGMA_SCHEDULES)}")
    starts = grid[:-1]
    if schedule == "flow_grpo":
        t_max = float(grid[1]) if len(grid) > 2 else 0.0
        sigmas = SIGMA_SCHEDULES[schedule](starts, eta, t_max=t_max)
    else:
        sigmas = SIGMA_SCHEDULES[schedule](starts, eta)
    sigmas = sigmas.to(torch.float64).clone()
    sigmas[-1] = 0.0
    return sigmas


def sde_window(step: int, num_steps: int, window_size: int, *, shift_every: int = 1, stride: int = 1) -> torch.Tensor:
    """MixGRPO's sliding window: [K] bool, True on the `window_size` SDE steps used at training step `step`.

    The window starts at the noisiest step and moves `stride` steps toward t = 0 every
    `shift_every` training steps, wrapping back to the start once it reaches the end of the
    grid's stochastic part (the last step, to t = 0, is never stochastic).
    """
    stochastic = num_steps - 1
    if not 1 <= window_size <= max(stochastic, 1):
        raise ValueError(f"sde_window_size must be in [1, {max(stochastic, 1)}] for {num_steps} denoising steps, "
                         f"got {window_size}")
    positions = stochastic - window_size + 1
    start = ((step // max(shift_every, 1)) * stride) % max(positions, 1)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[start:start + window_size] = True
    return mask


def group_noise(num_prompts: int, group_size: int, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """[num_prompts * group_size, *shape]: sample j of prompt p starts from prompt p's noise."""
    noise = torch.randn((num_prompts, *shape), generator=generator)
    return noise.repeat_interleave(group_size, dim=0)


@dataclass
class Trajectories:
    """What the SDE sampler records for a batch of B images over K steps."""

    latents: torch.Tensor
    """[B, K + 1, C, H, W]: x_0 (noise) ... x_K (the image)."""
    log_probs: torch.Tensor
    """[B, K]: log p(x_{k+1} | x_k) of SDE steps (0 on ODE steps)."""
    timesteps: torch.Tensor
    """[K + 1] float64: the time grid."""
    sde_mask: torch.Tensor
    """[K] bool: which steps were stochastic (the steps a policy loss uses)."""
    step_std: torch.Tensor
    """[K] float64: sigma_t sqrt(-dt) of each step (0 on ODE steps)."""
    sigmas: torch.Tensor
    """[K] float64: sigma_t of each step (0 on ODE steps)."""

    @property
    def images(self) -> torch.Tensor:
        return self.latents[:, -1]


@torch.no_grad()
def sample_ode(model, prompts: Sequence[str], noise: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Images [B, C, H, W] by Euler integration of the velocity from t = 1 to 0."""
    grid = time_grid(num_steps)
    conditioning = model.encode(prompts)
    x = noise.clone()
    for k in range(num_steps):
        t, dt = grid[k], grid[k + 1] - grid[k]
        x = x + model.velocity(x, t.to(x.dtype).reshape(1), conditioning) * dt.to(x.dtype)
    return x


def step_mean_and_log_prob(model, latent: torch.Tensor, next_latent: torch.Tensor, t: torch.Tensor,
                           dt: torch.Tensor, sigma: torch.Tensor, conditioning) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [B, C, H, W], log p [B]) of one SDE step under `model` (gradients flow when enabled).
    The one function the sampler and the policy loss both use, so pi_old matches the sampler."""
    dtype = latent.dtype
    velocity = model.velocity(latent, t.to(dtype).reshape(1), conditioning)
    mean = sde_step_mean(latent, velocity, t.to(dtype), dt.to(dtype), sigma.to(dtype))
    std = sde_step_std(sigma, dt).to(dtype)
    log_prob = torch.stack([sde_step_log_prob(next_latent[b], mean[b], std) for b in range(latent.shape[0])])
    return mean, log_prob


@torch.no_grad()
def sample_trajectories(model, prompts: Sequence[str], noise: torch.Tensor, num_steps: int, *, eta: float,
                        sigma_schedule: str = "flow_grpo", sde_mask: torch.Tensor | None = None,
                        generator: torch.Generator | None = None) -> Trajectories:
    """SDE sampling with every latent and each SDE step's log-probability recorded.

    `sde_mask` [K] bool selects the stochastic steps (None: all); a step whose sigma_t is 0 is
    an ODE step whatever the mask says.
    """
    grid = time_grid(num_steps)
    sigmas = step_sigmas(grid, eta, sigma_schedule)
    mask = torch.ones(num_steps, dtype=torch.bool) if sde_mask is None else sde_mask.clone().bool()
    if mask.shape != (num_steps,):
        raise ValueError(f"sde_mask has shape {tuple(mask.shape)}, expected ({num_steps},)")
    mask &= sigmas > 0
    sigmas = torch.where(mask, sigmas, torch.zeros_like(sigmas))
    conditioning = model.encode(prompts)
    x = noise.clone()
    latents, log_probs, stds = [x], [], []
    for k in range(num_steps):
        t, dt = grid[k], grid[k + 1] - grid[k]
        if mask[k]:
            velocity = model.velocity(x, t.to(x.dtype).reshape(1), conditioning)
            mean = sde_step_mean(x, velocity, t.to(x.dtype), dt.to(x.dtype), sigmas[k].to(x.dtype))
            std = sde_step_std(sigmas[k], dt)
            eps = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)  # a CPU generator on any device
            x_next = mean + std.to(x.dtype) * eps
            log_probs.append(torch.stack([sde_step_log_prob(x_next[b], mean[b], std.to(x.dtype))
                                          for b in range(x.shape[0])]))
            stds.append(float(std))
        else:
            x_next = x + model.velocity(x, t.to(x.dtype).reshape(1), conditioning) * dt.to(x.dtype)
            log_probs.append(torch.zeros(x.shape[0], dtype=x.dtype, device=x.device))
            stds.append(0.0)
        x = x_next
        latents.append(x)
    return Trajectories(latents=torch.stack(latents, dim=1), log_probs=torch.stack(log_probs, dim=1),
                        timesteps=grid, sde_mask=mask, step_std=torch.tensor(stds, dtype=torch.float64),
                        sigmas=sigmas)
