"""The six experimental diffusion recipes (flow-matching DiT / MMDiT models), registered in the
catalog with `@recipe` like the LLM ones and launched with `stacx train --algorithm <name>`:

| recipe              | step | what trains the policy                                                     |
| ------------------- | ---- | -------------------------------------------------------------------------- |
| `flow_matching_sft` | sft  | velocity regression on dataset images                                      |
| `flow_grpo`         | grpo | clipped policy loss over SDE steps, sigma_t = eta sqrt(t/(1-t)), KL to ref  |
| `dance_grpo`        | grpo | the same with sigma_t = eta and shared initial noise per prompt group      |
| `mix_grpo`          | grpo | SDE only inside a sliding window of steps, ODE elsewhere; loss on the window |
| `diffusion_dpo`     | dpo  | Diffusion-DPO on (chosen, rejected) image pairs against a frozen reference |
| `diffusion_nft`     | nft  | DiffusionNFT: forward-process loss on the policy's own clean samples       |

Each recipe has one trainable `policy` role whose Ray workers hold the model (data parallel; no
tensor parallelism), with an in-worker reference (`--ref-load`, else a frozen copy of the initial
policy) where KL or DPO needs one. Each recipe's `algorithm` is a `DiffusionAlgorithmConfig` holding
its sampler, data and loss defaults (`stacx.diffusion.algorithm_config`); the recipes run in the
`image` workload (`stacx.diffusion.workload`), registered before them.
"""

from __future__ import annotations

from stacx.diffusion.algorithm_config import DiffusionAlgorithmConfig, diffusion_algorithm
from stacx.diffusion.objective import (
    DiffusionDPOObjective,
    DiffusionNFTObjective,
    FlowGRPOObjective,
    FlowMatchingSFTObjective,
)
from stacx.diffusion.workload import IMAGE_MODALITY
from stacx.objectives import diffusion_loss  # noqa: F401  (registers flow_grpo_clip before the recipes name it)
from stacx.trainer.config.recipe import ModelRole, TrainingConfig, recipe


def _policy(objective_cls, *, samples: bool, with_reference: bool, description: str) -> ModelRole:
    return ModelRole(name="policy", specialization_cls=objective_cls, trainable=True, sync_to_rollout=samples,
                     checkpoint_arg="hf_checkpoint", reference_checkpoint_arg="ref_load" if with_reference else None,
                     description=description)


def _diffusion_recipe(name: str, *, description: str, role: ModelRole,
                      algorithm: DiffusionAlgorithmConfig) -> TrainingConfig:
    rollout = role.sync_to_rollout
    return TrainingConfig(name=name, roles=(role,), syncs=(), description=description, algorithm=algorithm,
                          data_source="rollout" if rollout else "dataset", uses_reward=rollout, modality=IMAGE_MODALITY,
                          experimental=True)


def _grpo_algorithm(**overrides):
    values = dict(advantage_estimator="grpo", policy_loss="flow_grpo_clip", loss_agg_mode="token-mean",
                  clip_ratio_low=1e-4, clip_ratio_high=1e-4)
    values.update(overrides)
    return diffusion_algorithm(**values)


_SDE_POLICY = _policy(FlowGRPOObjective, samples=True, with_reference=True,
                      description="image model sampling its own SDE trajectories; loss flow_grpo_clip")

DIFFUSION_RECIPES: dict[str, tuple[str, ModelRole, DiffusionAlgorithmConfig]] = {
    "flow_matching_sft": (
        "Flow-matching SFT of a DiT / MMDiT image model: the velocity v_theta(x_t, t, prompt) regresses "
        "eps - x0 on dataset images (built-in: coloured shapes named by the prompt).",
        _policy(FlowMatchingSFTObjective, samples=False, with_reference=False,
                description="image model trained by velocity regression (loss flow_matching)"),
        diffusion_algorithm(),
    ),
    "flow_grpo": (
        "Flow-GRPO: the ODE sampler turned into an SDE with sigma_t = eta sqrt(t / (1 - t)); each "
        "prompt's group of images is scored, rewards are normalized within the group, and the clipped "
        "policy loss runs over every SDE step, with the Gaussian KL of each step to the reference.",
        _SDE_POLICY,
        _grpo_algorithm(use_kl_loss=True, kl_loss_coef=0.04, sde_sigma_schedule="flow_grpo", sde_eta=0.7),
    ),
    "dance_grpo": (
        "DanceGRPO: GRPO over SDE steps with a constant sigma_t = eta, every image of a prompt's group "
        "starting from the same initial noise (the group differs only by the SDE's noise); no KL.",
        _SDE_POLICY,
        _grpo_algorithm(sde_sigma_schedule="dance_grpo", sde_eta=0.3, shared_group_noise=True),
    ),
    "mix_grpo": (
        "MixGRPO: SDE sampling only inside a sliding window of denoising steps (ODE elsewhere); the "
        "window moves from the noisiest steps toward t = 0 as training goes on, and the clipped policy "
        "loss covers the window's steps only.",
        _policy(FlowGRPOObjective, samples=True, with_reference=True,
                description="image model sampling mixed ODE-SDE trajectories; loss flow_grpo_clip"),
        _grpo_algorithm(sde_sigma_schedule="flow_grpo", sde_eta=0.7, sde_window_size=2, sde_window_shift_every=2,
                        shared_group_noise=True),
    ),
    "diffusion_dpo": (
        "Flow / Diffusion-DPO: on (chosen, rejected) image pairs noised with the same t and eps, the "
        "policy's velocity error is pushed below the frozen reference's on the chosen image and above it "
        "on the rejected one (built-in pairs: the named colour vs another colour).",
        _policy(DiffusionDPOObjective, samples=False, with_reference=True,
                description="image model trained on preference pairs; loss diffusion_dpo"),
        diffusion_algorithm(),
    ),
    "diffusion_nft": (
        "DiffusionNFT: forward-process RL; the policy samples clean images with the ODE solver, "
        "rewards become an optimality probability per image, and flow matching on those images "
        "contrasts an implicit positive and negative policy (no likelihoods, no SDE).",
        _policy(DiffusionNFTObjective, samples=True, with_reference=False,
                description="image model trained on its own clean samples; loss diffusion_nft"),
        _grpo_algorithm(),
    ),
}
"""The diffusion recipes by name: (description, policy role, algorithm). They share one recipe shape
(`_diffusion_recipe`) and differ only in this data."""


def _register_diffusion_recipe(name: str, description: str, role: ModelRole, algorithm: DiffusionAlgorithmConfig):
    recipe(name)(lambda: _diffusion_recipe(name, description=description, role=role, algorithm=algorithm))


for _name, (_description, _role, _algorithm) in DIFFUSION_RECIPES.items():
    _register_diffusion_recipe(_name, _description, _role, _algorithm)
