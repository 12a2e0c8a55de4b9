"""Flow-matching kernels for DiT / MMDiT image models (experimental): pure math on per-sample lists.

Convention (rectified flow, as in SD3 and Flow-GRPO): a clean image x0 and Gaussian noise eps are
joined by the straight path

    x_t = (1 - t) x0 + t eps,        t in [0, 1]  (t = 1: pure noise)

and the model predicts the velocity v_theta(x_t, t, c) ~ dx_t/dt = eps - x0. Sampling integrates
from t = 1 down to t = 0 with steps dt = t_next - t < 0.

Every kernel takes lists with one tensor per sample (any shape, e.g. [C, H, W] latents, or
[S_i] for per-denoising-step quantities), never aggregates over samples, and returns per-sample
losses plus metric SUMS, exactly like the LLM kernels: the framework reduces with one global
count (`stacx.parallel.reduction.Reducer`), so the gradient does not depend on how samples are
split over data-parallel ranks and micro-batches. Per-image quantities (squared errors,
log-densities) are MEANS over the image's elements, as in the papers' reference code.

Kernels that are losses are registered: the clipped policy loss in POLICY_LOSSES (its signature
is the LLM one, with denoising steps in place of tokens), the others in LOSSES. Hyperparameters
are read from `config` (clip ratios, `kl_loss_coef` are declared algorithm fields; `nft_beta`,
`diffusion_dpo_beta` are fields of the diffusion recipes' `DiffusionAlgorithmConfig`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from stacx.objectives.registry import register_loss, register_policy_loss
from stacx.objectives.validation import check_trajectory_lists, hyperparameter, split_like

LOG_RATIO_CLAMP = 20.0
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_sample_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean over every element of one sample -> shape (1,) (the per-sample loss shape)."""
    return values.reshape(1, -1).mean(dim=1)


def _check_same_shapes(name: str, reference: Sequence[torch.Tensor], **others: Sequence[torch.Tensor] | None) -> None:
    """Every list in `others` has one tensor per sample of `reference`, of the same shape."""
    if not isinstance(reference, (list, tuple)) or not reference:
        raise ValueError(f"{name} must be a non-empty list of per-sample tensors")
    for other_name, values in others.items():
        if values is None:
            continue
        if len(values) != len(reference):
            raise ValueError(f"{other_name} has {len(values)} samples but {name} has {len(reference)}")
        for index, (a, b) in enumerate(zip(reference, values)):
            if a.shape != b.shape:
                raise ValueError(f"sample {index}: {other_name} has shape {tuple(b.shape)} but {name} has "
                                 f"shape {tuple(a.shape)}")


def _setting(config, name: str):
    """`config.<name>` for diffusion-only knobs (fields of the diffusion recipes' algorithm config), else a
    declared algorithm hyperparameter."""
    value = getattr(config, name, None) if config is not None else None
    return value if value is not None else hyperparameter(config, name)


# ---- flow matching ------------------------------------------------------------------------------


def flow_matching_target(clean: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """u = eps - x0, the velocity of the straight path x_t = (1 - t) x0 + t eps."""
    return noise - clean


def noised_latent(clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps (t a float or a 0-dim tensor)."""
    return (1.0 - t) * clean + t * noise


@register_loss("flow_matching")
def flow_matching_loss(config, velocity: Sequence[torch.Tensor], clean: Sequence[torch.Tensor],
                       noise: Sequence[torch.Tensor], **kwargs):
    """Rectified-flow velocity regression (Lipman et al. 2023; Liu et al. 2023; SD3).

        l_i = mean_elements( (v_theta(x_t_i, t_i) - (eps_i - x0_i))^2 )

    velocity: v_theta per sample (carries gradients); clean: x0; noise: eps (same shapes).
    Returns ([l_i of shape (1,)], {"fm_loss": sum_i l_i}).
    """
    _check_same_shapes("velocity", velocity, clean=clean, noise=noise)
    losses = [_per_sample_mean((v - flow_matching_target(x0.detach(), e.detach()).to(v.dtype)) ** 2)
              for v, x0, e in zip(velocity, clean, noise)]
    return losses, {"fm_loss": torch.stack([l.detach()[0] for l in losses]).sum()}


# ---- the SDE step of the ODE-to-SDE conversion --------------------------------------------------


def flow_grpo_sigma(t: torch.Tensor | float, eta: float, t_max: float | None = None) -> torch.Tensor:
    """Flow-GRPO's diffusion coefficient sigma_t = eta * sqrt(t / (1 - t)).

    At t = 1 the ratio is infinite; like Flow-GRPO, pass `t_max` (the largest schedule value below
    1) and t is capped at it inside the ratio.
    """
    t = torch.as_tensor(t, dtype=torch.float64 if not isinstance(t, torch.Tensor) else t.dtype)
    capped = t if t_max is None else torch.clamp(t, max=t_max)
    if bool((capped >= 1).any()):
        raise ValueError("flow_grpo_sigma: t = 1 makes sigma_t infinite; pass t_max (the largest timestep below 1)")
    return eta * torch.sqrt(capped / (1.0 - capped))


def dance_grpo_sigma(t: torch.Tensor | float, eta: float) -> torch.Tensor:
    """DanceGRPO's constant diffusion coefficient sigma_t = eta."""
    t = torch.as_tensor(t)
    return torch.full_like(t, float(eta), dtype=t.dtype if t.is_floating_point() else torch.float64)


SIGMA_SCHEDULES = {"flow_grpo": flow_grpo_sigma, "dance_grpo": dance_grpo_sigma}
"""Name -> sigma_t rule (the diffusion recipes' `sde_sigma_schedule`)."""


def sde_step_mean(latent: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor | float,
                  dt: torch.Tensor | float, sigma: torch.Tensor | float) -> torch.Tensor:
    """Mean of one Euler-Maruyama step of the reverse SDE with the flow's marginals.

        mu = x_t + [ v + sigma_t^2 / (2 t) * (x_t + (1 - t) v) ] * dt,     dt = t_next - t < 0

    The bracket is v - (sigma_t^2 / 2) * score, with the score of x_t = (1 - t) x0 + t eps
    expressed through v: grad log p_t(x) = -(x + (1 - t) v) / t (Flow-GRPO eq. 9; DanceGRPO uses
    the same step with sigma_t = eta). At sigma_t = 0 it is the ODE (Euler) step x_t + v dt.
    """
    return latent + (velocity + (sigma ** 2) / (2.0 * t) * (latent + (1.0 - t) * velocity)) * dt


def sde_step_std(sigma: torch.Tensor | float, dt: torch.Tensor | float) -> torch.Tensor:
    """Standard deviation of the step's Gaussian: sigma_t * sqrt(-dt)."""
    return torch.as_tensor(sigma) * torch.sqrt(-torch.as_tensor(dt))


def sde_step_log_prob(next_latent: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Gaussian log-density of the sampled next latent, averaged over its elements (Flow-GRPO's
    convention), for ONE sample:

        log p = mean_elements( -(x_next - mu)^2 / (2 s^2) - log s - log sqrt(2 pi) ),    s = std > 0

    `next_latent` is treated as data (detached); gradients flow through `mean`. Returns shape ().
    """
    std = torch.as_tensor(std, dtype=mean.dtype)
    if bool((std <= 0).any()):
        raise ValueError("sde_step_log_prob: std must be > 0 (a deterministic ODE step has no density)")
    element = -((next_latent.detach() - mean) ** 2) / (2.0 * std ** 2) - torch.log(std) - _LOG_SQRT_2PI
    return element.mean()


# ---- GRPO over denoising steps ------------------------------------------------------------------


def _clip_bounds(config) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each defaulting to clip_ratio."""
    both = hyperparameter(config, "clip_ratio")
    low, high = hyperparameter(config, "clip_ratio_low"), hyperparameter(config, "clip_ratio_high")
    return float(both if low is None else low), float(both if high is None else high)


@register_policy_loss("flow_grpo_clip", token_local=True)
def flow_grpo_clip(config, old_log_prob, log_prob, advantages, loss_masks, *, mean=None, ref_mean=None,
                   step_std=None, **kwargs):
    """Flow-GRPO / DanceGRPO / MixGRPO clipped policy loss over the SDE denoising steps of each image.

    Per sample i and SDE step k (the "tokens" of the LLM losses):

        rho_ik = exp(log p_theta(x_{k+1} | x_k) - log p_old(x_{k+1} | x_k))
        l_ik   = max(-A_i rho_ik, -A_i clip(rho_ik, 1 - clip_ratio_low, 1 + clip_ratio_high))
               + kl_loss_coef * KL_ik                                      (when use_kl_loss)
        KL_ik  = mean_elements( (mu_theta_ik - mu_ref_ik)^2 ) / (2 s_ik^2)

    KL_ik is the KL divergence between the two Gaussian steps (same std s_ik = sigma_t sqrt(-dt)),
    per element, as in Flow-GRPO. Inputs: lists of (S_i,) tensors (one entry per SDE step of
    image i); `mean`/`ref_mean`: lists of [S_i, *latent] step means (policy with gradients,
    reference detached); `step_std`: list of (S_i,). Returns ([l_i (S_i,)], metric sums).
    """
    lengths = check_trajectory_lists("log_prob", log_prob, old_log_prob=old_log_prob, advantages=advantages,
                                     loss_masks=loss_masks, step_std=step_std)
    if not lengths:
        raise ValueError("log_prob is empty: the policy loss needs at least one image")
    new = torch.cat(list(log_prob))
    old = torch.cat(list(old_log_prob)).detach().to(new.dtype)
    adv = torch.cat(list(advantages)).detach().to(new.dtype)
    mask = torch.cat(list(loss_masks)).detach().to(new.dtype)
    low, high = _clip_bounds(config)
    ratio = torch.exp((new - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_loss": (loss.detach() * mask).sum(),
               "pg_clipfrac": ((clipped > unclipped).to(new.dtype) * mask).sum(),
               "ppo_kl": ((old - new.detach()) * mask).sum()}
    if bool(hyperparameter(config, "use_kl_loss")):
        if mean is None or ref_mean is None or step_std is None:
            raise ValueError("use_kl_loss needs mean, ref_mean and step_std (the policy's and the reference's step "
                             "means); give the run a reference (--ref-load) or turn the KL loss off")
        _check_same_shapes("mean", mean, ref_mean=ref_mean)
        kl = torch.cat([((m - r.detach().to(m.dtype)) ** 2).reshape(m.shape[0], -1).mean(dim=1)
                        / (2.0 * s.detach().to(m.dtype) ** 2)
                        for m, r, s in zip(mean, ref_mean, step_std)])
        loss = loss + float(hyperparameter(config, "kl_loss_coef")) * kl
        metrics["kl_loss"] = (kl.detach() * mask).sum()
    return split_like(loss, lengths), metrics


# ---- preference pairs: Diffusion-DPO for flow matching ------------------------------------------


@register_loss("diffusion_dpo")
def diffusion_dpo_loss(config, velocity_chosen, velocity_rejected, ref_velocity_chosen, ref_velocity_rejected,
                       target_chosen, target_rejected, **kwargs):
    """Diffusion-DPO (Wallace et al. 2023) with the velocity error of flow matching in place of the
    noise error. For pair i, both images noised at the same t with the same eps:

        e^w = mean((v_theta(x^w_t) - u^w)^2),  e^w_ref = mean((v_ref(x^w_t) - u^w)^2),  same for l
        l_i = -log sigmoid( -(beta / 2) * [ (e^w - e^w_ref) - (e^l - e^l_ref) ] )

    u = eps - x0 (`target_*`); beta is `diffusion_dpo_beta` (Diffusion-DPO uses thousands, since e
    is a mean over pixels; the LLM `dpo_beta` is not used). Every list holds one tensor per pair; chosen and rejected must have the same
    shape (the pair is noised with the same eps). Returns ([l_i of shape (1,)], metric sums).
    """
    _check_same_shapes("velocity_chosen", velocity_chosen, velocity_rejected=velocity_rejected,
                       ref_velocity_chosen=ref_velocity_chosen, ref_velocity_rejected=ref_velocity_rejected,
                       target_chosen=target_chosen, target_rejected=target_rejected)
    beta = float(_setting(config, "diffusion_dpo_beta"))
    losses, margins, accuracies = [], [], []
    for vw, vl, rw, rl, uw, ul in zip(velocity_chosen, velocity_rejected, ref_velocity_chosen,
                                      ref_velocity_rejected, target_chosen, target_rejected):
        err = lambda v, u: _per_sample_mean((v - u.detach().to(v.dtype)) ** 2)  # noqa: E731
        model_diff = err(vw, uw) - err(vl, ul)
        ref_diff = (err(rw.detach(), uw) - err(rl.detach(), ul)).to(model_diff.dtype)
        logits = -0.5 * beta * (model_diff - ref_diff)
        losses.append(-torch.nn.functional.logsigmoid(logits))
        margins.append(logits.detach()[0])
        accuracies.append((logits.detach()[0] > 0).to(logits.dtype))
    metrics = {"dpo_loss": torch.stack([l.detach()[0] for l in losses]).sum(),
               "dpo_margin": torch.stack(margins).sum(), "dpo_accuracy": torch.stack(accuracies).sum()}
    return losses, metrics


# ---- forward-process RL: DiffusionNFT and Advantage Weighted Matching ---------------------------


def nft_optimality(advantages: torch.Tensor, advantage_clip: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = 1/2 + 1/2 * clip(A / advantage_clip, -1, 1) in [0, 1]."""
    return 0.5 + 0.5 * torch.clamp(advantages / advantage_clip, -1.0, 1.0)


@register_loss("diffusion_nft")
def diffusion_nft_loss(config, velocity, old_velocity, clean, noise, optimality, **kwargs):
    """DiffusionNFT (Zheng et al. 2025): flow matching on the policy's own clean samples, contrasting
    an implicit positive and negative policy built around the sampling (old) policy:

        v+ = (1 - beta) v_old + beta v_theta,       v- = (1 + beta) v_old - beta v_theta
        l_i = r_i * mean((v+ - u_i)^2) + (1 - r_i) * mean((v- - u_i)^2),     u_i = eps_i - x0_i

    r_i in [0, 1] is the sample's optimality probability (`nft_optimality` of its advantage);
    beta is `nft_beta`. velocity: v_theta(x_t) with gradients; old_velocity: v_old(x_t), detached;
    optimality: one 0-dim or (1,) tensor per sample. Returns ([l_i of shape (1,)], metric sums).
    """
    _check_same_shapes("velocity", velocity, old_velocity=old_velocity, clean=clean, noise=noise)
    if len(optimality) != len(velocity):
        raise ValueError(f"optimality has {len(optimality)} samples but velocity has {len(velocity)}")
    beta = float(_setting(config, "nft_beta"))
    losses = []
    for v, v_old, x0, eps, r in zip(velocity, old_velocity, clean, noise, optimality):
        u = flow_matching_target(x0.detach(), eps.detach()).to(v.dtype)
        v_old = v_old.detach().to(v.dtype)
        r = torch.as_tensor(r, dtype=v.dtype).detach().reshape(())
        positive = (1.0 - beta) * v_old + beta * v
        negative = (1.0 + beta) * v_old - beta * v
        losses.append(r * _per_sample_mean((positive - u) ** 2) + (1.0 - r) * _per_sample_mean((negative - u) ** 2))
    return losses, {"nft_loss": torch.stack([l.detach()[0] for l in losses]).sum()}


@register_loss("advantage_weighted_matching")
def advantage_weighted_matching_loss(config, velocity, clean, noise, advantages, **kwargs):
    """Advantage Weighted Matching: the flow-matching loss on the policy's own samples, weighted by
    each sample's (group-normalized) advantage, so high-reward images are pulled in and low-reward
    ones pushed out:

        l_i = A_i * mean((v_theta(x_t_i) - (eps_i - x0_i))^2)

    advantages: one 0-dim or (1,) tensor per sample. Returns ([l_i of shape (1,)], metric sums).
    """
    _check_same_shapes("velocity", velocity, clean=clean, noise=noise)
    if len(advantages) != len(velocity):
        raise ValueError(f"advantages has {len(advantages)} samples but velocity has {len(velocity)}")
    losses = [torch.as_tensor(a, dtype=v.dtype).detach().reshape(())
              * _per_sample_mean((v - flow_matching_target(x0.detach(), e.detach()).to(v.dtype)) ** 2)
              for v, x0, e, a in zip(velocity, clean, noise, advantages)]
    return losses, {"awm_loss": torch.stack([l.detach()[0] for l in losses]).sum()}


__all__ = [
    "SIGMA_SCHEDULES",
    "advantage_weighted_matching_loss",
    "dance_grpo_sigma",
    "diffusion_dpo_loss",
    "diffusion_nft_loss",
    "flow_grpo_clip",
    "flow_grpo_sigma",
    "flow_matching_loss",
    "flow_matching_target",
    "nft_optimality",
    "noised_latent",
    "sde_step_log_prob",
    "sde_step_mean",
    "sde_step_std",
]
