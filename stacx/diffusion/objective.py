"""Loss assembly of the diffusion recipes' policy role: one `DiffusionObjective` subclass per kind of
step, composing the kernels of `stacx.objectives.diffusion_loss` (looked up in the registries by
name) with the one reduction contract (`stacx.parallel.reduction.Reducer`).

`DiffusionObjective` is its own base, not a `Specialization`: an LLM specialization turns the model's
output on a packed token batch into per-token terms, a diffusion objective calls the model itself
(velocities at noised latents, SDE step log-probs) on a batch of images. Its one call is

    loss, metric_sums = objective.compute_loss(model, reference, batch, reducer)

on one micro-batch of one data-parallel rank: the loss to call backward on and detached metric
sums. The Reducer is built once per step from the GLOBAL number of loss terms (`loss_terms`: SDE
steps of all images for `grpo`; images or pairs otherwise, each a one-entry "token"), so the summed
gradient is the same for every split of the batch over ranks and micro-batches. Per-sample
randomness (t and eps of the forward process) is drawn by the driver per sample, never per rank.
"""

from __future__ import annotations

from typing import Any

import torch

from stacx.diffusion.sampling import step_mean_and_log_prob
from stacx.objectives.diffusion_loss import noised_latent, nft_optimality
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import get_loss, get_policy_loss
from stacx.parallel.reduction import Reducer


def _ones(n: int) -> list[torch.Tensor]:
    return [torch.ones(1) for _ in range(n)]


def _velocity_at(model, clean_BCHW, noise_BCHW, t_B, conditioning) -> torch.Tensor:
    x_t = noised_latent(clean_BCHW, noise_BCHW, t_B.view(-1, 1, 1, 1).to(clean_BCHW.dtype))
    return model.velocity(x_t, t_B.to(clean_BCHW.dtype), conditioning)


class DiffusionObjective:
    """Base of the diffusion policy objectives (see the module docstring). Subclasses set `kind` and
    `loss_name` and write `compute_loss`; `uses_reference` and `loss_terms` have the common answers."""

    kind: str = ""
    """Which step the driver runs: sft, grpo, dpo or nft (`KINDS`)."""
    loss_name: str = ""
    """The registered kernel this objective calls."""

    def __init__(self, config: AlgorithmConfig):
        self.config = config
        """The run's algorithm config (a `DiffusionAlgorithmConfig`; tests pass a plain one): what the kernels read."""

    def uses_reference(self) -> bool:
        """Whether a frozen reference model is needed (KL, DPO)."""
        return False

    def loss_terms(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """One (n_i,) mask per sample of the WHOLE batch of this rank (for the global count)."""
        return _ones(len(batch["prompts"]))

    def compute_loss(self, model, reference, batch: dict[str, Any],
                     reducer: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss of this micro-batch under the step's reducer, detached metric sums)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss")


class FlowMatchingSFTObjective(DiffusionObjective):
    """Flow-matching regression of the velocity on dataset images."""

    kind, loss_name = "sft", "flow_matching"

    def compute_loss(self, model, reference, batch, reducer):
        clean, noise = batch["images"], batch["noise"]
        velocity = _velocity_at(model, clean, noise, batch["t"], model.encode(batch["prompts"]))
        losses, metrics = get_loss(self.loss_name)(self.config, list(velocity), list(clean), list(noise))
        return reducer(losses, _ones(len(losses))), metrics


class FlowGRPOObjective(DiffusionObjective):
    """The clipped policy loss over the SDE steps of each sampled image (Flow-GRPO, DanceGRPO, MixGRPO),
    with the Gaussian KL of each step to the reference when `use_kl_loss`."""

    kind = "grpo"

    @property
    def loss_name(self) -> str:  # the run's policy loss (flow_grpo_clip unless the user registers another)
        return self.config.policy_loss

    def uses_reference(self) -> bool:
        return self.config.use_kl_loss

    def loss_terms(self, batch):
        num_sde_steps = int(batch["sde_mask"].sum())
        return [torch.ones(num_sde_steps) for _ in batch["prompts"]]

    def compute_loss(self, model, reference, batch, reducer):
        steps = [int(k) for k in torch.nonzero(batch["sde_mask"]).flatten()]
        latents, grid, sigmas = batch["latents"], batch["timesteps"], batch["sigmas"]
        conditioning = model.encode(batch["prompts"])
        ref_conditioning = reference.encode(batch["prompts"]) if self.uses_reference() else None
        means, log_probs, ref_means = [], [], []
        for k in steps:
            t, dt = grid[k], grid[k + 1] - grid[k]
            mean, log_prob = step_mean_and_log_prob(model, latents[:, k], latents[:, k + 1], t, dt, sigmas[k],
                                                    conditioning)
            means.append(mean)
            log_probs.append(log_prob)
            if ref_conditioning is not None:
                with torch.no_grad():
                    ref_means.append(step_mean_and_log_prob(reference, latents[:, k], latents[:, k + 1], t, dt,
                                                            sigmas[k], ref_conditioning)[0])
        num = latents.shape[0]
        log_prob_BS = torch.stack(log_probs, dim=1)
        old_BS = batch["old_log_probs"][:, steps]
        adv_BS = batch["advantages"].view(-1, 1).expand(num, len(steps)).to(log_prob_BS.dtype)
        std_S = batch["step_std"][steps]
        kwargs = {}
        if ref_means:
            mean_BS = torch.stack(means, dim=1)
            ref_BS = torch.stack(ref_means, dim=1)
            kwargs = dict(mean=list(mean_BS), ref_mean=list(ref_BS), step_std=[std_S for _ in range(num)])
        masks = [torch.ones(len(steps)) for _ in range(num)]
        losses, metrics = get_policy_loss(self.loss_name)(self.config, list(old_BS), list(log_prob_BS), list(adv_BS),
                                                          masks, **kwargs)
        return reducer(losses, masks), metrics


class DiffusionDPOObjective(DiffusionObjective):
    """Diffusion-DPO on (chosen, rejected) image pairs against the frozen reference."""

    kind, loss_name = "dpo", "diffusion_dpo"

    def uses_reference(self) -> bool:
        return True

    def compute_loss(self, model, reference, batch, reducer):
        chosen, rejected, noise, t = batch["chosen"], batch["rejected"], batch["noise"], batch["t"]
        if chosen.shape != rejected.shape:
            raise ValueError(f"DPO pairs: chosen images have shape {tuple(chosen.shape)} but rejected images "
                             f"{tuple(rejected.shape)}; both images of a pair must have the same shape")
        conditioning = model.encode(batch["prompts"])
        v_w = _velocity_at(model, chosen, noise, t, conditioning)
        v_l = _velocity_at(model, rejected, noise, t, conditioning)
        with torch.no_grad():
            ref_conditioning = reference.encode(batch["prompts"])
            r_w = _velocity_at(reference, chosen, noise, t, ref_conditioning)
            r_l = _velocity_at(reference, rejected, noise, t, ref_conditioning)
        losses, metrics = get_loss(self.loss_name)(self.config, list(v_w), list(v_l), list(r_w), list(r_l),
                                                   list(noise - chosen), list(noise - rejected))
        return reducer(losses, _ones(len(losses))), metrics


class DiffusionNFTObjective(DiffusionObjective):
    """DiffusionNFT on the policy's own clean samples; the sampling policy's velocity is v_old (one
    optimizer step per rollout: v_old = sg(v_theta) at the step's start)."""

    kind, loss_name = "nft", "diffusion_nft"

    def compute_loss(self, model, reference, batch, reducer):
        clean, noise = batch["images"], batch["noise"]
        velocity = _velocity_at(model, clean, noise, batch["t"], model.encode(batch["prompts"]))
        optimality = nft_optimality(batch["advantages"].to(velocity.dtype),
                                    float(self.config.nft_advantage_clip))
        losses, metrics = get_loss(self.loss_name)(self.config, list(velocity), list(velocity.detach()), list(clean),
                                                   list(noise), list(optimality))
        return reducer(losses, _ones(len(losses))), metrics


OBJECTIVES = {cls.kind: cls for cls in (FlowMatchingSFTObjective, FlowGRPOObjective, DiffusionDPOObjective,
                                        DiffusionNFTObjective)}
"""kind -> its objective class."""

KINDS = tuple(OBJECTIVES)
"""How a step trains: flow-matching regression on data, the clipped policy loss over SDE steps,
preference pairs, or forward-process RL on the policy's own clean samples."""
