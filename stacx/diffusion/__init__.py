"""Experimental diffusion post-training, the `image` workload: flow-matching DiT / MMDiT image models
(diffusers), their conditioners, samplers, image rewards, objectives, per-rank runtime, worker group
and the driver loop of the six diffusion recipes.

    stacx.diffusion.config           DiffusionModelConfig: the model, built from a config (no download)
    stacx.diffusion.conditioning     label and text conditioners (prompt -> model conditioning)
    stacx.diffusion.models           DiffusionModel: transformer + conditioner -> velocity
    stacx.diffusion.checkpoint       save / load in the diffusers folder layout
    stacx.diffusion.sampling         ODE and SDE samplers, MixGRPO's window, group sampling
    stacx.diffusion.prompts          the built-in colour / shape prompt set and its target renderer
    stacx.diffusion.rewards          image reward interface and the built-in programmatic rewards
    stacx.diffusion.algorithm_config DiffusionAlgorithmConfig: the AlgorithmConfig with the diffusion knobs
    stacx.diffusion.objective        DiffusionObjective and its four kinds (sft, grpo, dpo, nft)
    stacx.diffusion.runtime          DiffusionRuntime: one rank of the policy role
    stacx.diffusion.group            DiffusionPolicyGroup: the typed calls of the policy's Ray workers
    stacx.diffusion.loop             DiffusionDriver / DiffusionRun: the driver loop of `stacx train`
    stacx.diffusion.workload         the `image` workload, registered in stacx.trainer.config.workload
    stacx.diffusion.recipes          the six @recipe definitions (what stacx.launch.workloads imports)

Loss math lives in `stacx.objectives.diffusion_loss`. Heavy imports (diffusers, Ray) happen in the
modules that use them.
"""
