"""Experimental diffusion post-training: flow-matching DiT / MMDiT image models (diffusers), their
conditioners, samplers, image rewards, the role-worker code and the loop of the six diffusion recipes.

    stacx.diffusion.config       DiffusionModelConfig: the model, built from a config (no download)
    stacx.diffusion.conditioning label and text conditioners (prompt -> model conditioning)
    stacx.diffusion.models       DiffusionModel: transformer + conditioner -> velocity
    stacx.diffusion.checkpoint   save / load in the diffusers folder layout
    stacx.diffusion.sampling     ODE and SDE samplers, MixGRPO's window, group sampling
    stacx.diffusion.prompts      the built-in colour / shape prompt set and its target renderer
    stacx.diffusion.rewards      image reward interface and the built-in programmatic rewards
    stacx.diffusion.settings     DiffusionSettings: sampler and loss knobs of a run
    stacx.diffusion.worker       what the policy's Ray role workers run
    stacx.diffusion.loop         the driver loop of `stacx train --algorithm <diffusion recipe>`
    stacx.diffusion.recipes      the six @recipe definitions

Loss math lives in `stacx.objectives.diffusion_loss`. Heavy imports (diffusers, Ray) happen in the
modules that use them.
"""
