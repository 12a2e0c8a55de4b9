"""A one-process training checkpoint made from a Hugging Face folder (what a tp=1 trainer saves)."""

from __future__ import annotations

import torch


def write_training_checkpoint(hf_dir: str, root, step: int, *, scale: float = 1.0, recipe: str = "sft",
                              role: str = "policy") -> str:
    """A complete `step_*` folder under `root` whose `role` holds `hf_dir`'s weights times `scale`."""
    from stacx.checkpointing.convert import single_process_world
    from stacx.checkpointing.folders import load_model_weights
    from stacx.models import build_model
    from stacx.trainer.checkpoint import (
        RoleLayout,
        begin_checkpoint,
        capture_rng_state,
        commit_checkpoint,
        write_rank_state,
    )

    with single_process_world() as groups:
        model = build_model(hf_dir, groups, initialize_weights=False)
        load_model_weights(model, hf_dir, groups, flag="--hf-checkpoint")
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
        staging = begin_checkpoint(root, step)
        info = write_rank_state(staging, role, 0, {"rng": capture_rng_state(), "num_steps": step},
                                model=model, groups=groups)
        layout = RoleLayout(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1)
        return commit_checkpoint(staging, step=step, recipe=recipe, role_layouts={role: layout}, rank_files=[info],
                                 driver_state={"step": step}, resolved_run_config={"model": {"hf_checkpoint": hf_dir}})


def read_torch_dist_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist folder by its checkpoint key, whole (global shape), read in this process
    without a model or a process group (the layer-stacked keys hold all layers, the vocab rows their padding)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return {key: value for key, value in _load_state_dict_from_keys(checkpoint_id=str(folder)).items()
            if torch.is_tensor(value)}
