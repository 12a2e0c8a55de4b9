"""One role's weights of a training checkpoint (`--save` folder, `step_*`) as a Hugging Face folder.

    base = base_checkpoint_of(step_folder)                        # the run's --hf-checkpoint
    export_role_to_hf(step_folder, "policy", base, out_dir)       # config.json + safetensors

A training checkpoint holds each rank's megatron parameters (`roles/<role>/rank_*.pt`, key
"model"), TP-sharded, with the vocabulary padded. The export writes the tensor-parallel shards
(ranks with cp = dp = 0) as a Stacx model folder and merges it with `convert_stacx_to_hf`, so any
saved TP size works and the vocabulary padding is stripped. The config and the tokenizer come
from the checkpoint the run started from (`base`), which the run config records.
"""

from __future__ import annotations

import os
import tempfile

from safetensors.torch import save_file

from stacx.trainer.checkpoint import CheckpointError, LoadedCheckpoint, read_manifest


def pick_role(manifest: dict, role: str | None) -> str:
    """`role` when given, else the checkpoint's only role, else 'policy' or 'actor' (the rollout roles)."""
    roles = sorted(manifest.get("roles", {}))
    if role is not None:
        if role not in roles:
            raise CheckpointError(f"--role {role!r}: the checkpoint has no such role; its roles: {roles}")
        return role
    if len(roles) == 1:
        return roles[0]
    for name in ("policy", "actor"):
        if name in roles:
            return name
    raise CheckpointError(f"the checkpoint has roles {roles}; choose one with --role")


def base_checkpoint_of(step_folder: str | os.PathLike, override: str | None = None) -> str:
    """The Hugging Face folder the run started from (`model.hf_checkpoint` of its run_config.json),
    or `override`; a moved or deleted folder is named with the flag that fixes it."""
    # Imported here: megatron-core is slow to import (start-up time).
    from stacx.models.checkpoint import CheckpointNotFoundError, require_hf_checkpoint_folder

    if override is not None:
        return require_hf_checkpoint_folder(override)
    loaded = LoadedCheckpoint(path=str(step_folder), manifest=read_manifest(step_folder), expected_layouts={})
    base = (loaded.run_config().get("model") or {}).get("hf_checkpoint")
    if not base:
        raise CheckpointError(f"{step_folder}/run_config.json names no model.hf_checkpoint; pass --hf-checkpoint "
                              "with the folder the run started from (its config.json and tokenizer are needed)")
    try:
        return require_hf_checkpoint_folder(base)
    except CheckpointNotFoundError as err:
        raise CheckpointError(f"{err}. The run in {step_folder} started from it and its config.json and tokenizer "
                              "are needed; pass --hf-checkpoint with that folder's new place") from None


def export_role_to_hf(step_folder: str | os.PathLike, role: str, base: str, out_dir: str | os.PathLike) -> str:
    """Write `role`'s weights at `step_folder` as a Hugging Face checkpoint in `out_dir`; returns it."""
    # Imported here: megatron-core is slow to import (start-up time).
    from stacx.models.architectures import load_hf_config
    from stacx.models.checkpoint import copy_tokenizer_files
    from stacx.models.stacx_checkpoint import _write_metadata, convert_stacx_to_hf

    loaded = LoadedCheckpoint(path=str(step_folder), manifest=read_manifest(step_folder), expected_layouts={})
    tp_size = loaded.saved_layout(role).tensor_parallel_size
    entries = {entry["tp_rank"]: entry for entry in loaded.manifest["roles"][role]["ranks"]
               if entry["cp_rank"] == 0 and entry["dp_rank"] == 0}
    missing = sorted(set(range(tp_size)) - set(entries))
    if missing:
        raise CheckpointError(f"checkpoint {step_folder}: role {role!r} has no file for tp rank {missing[0]}")
    with tempfile.TemporaryDirectory(prefix="stacx-export-") as stacx_dir:
        for tp_rank in range(tp_size):
            model_state = loaded.rank_state(role, entries[tp_rank]["rank"])["model"]
            save_file({name: tensor.contiguous() for name, tensor in model_state.items()},
                      os.path.join(stacx_dir, f"tp_rank_{tp_rank:02d}.safetensors"), metadata={"format": "pt"})
        _write_metadata(stacx_dir, tp_size, load_hf_config(base))
        convert_stacx_to_hf(stacx_dir, str(out_dir))
    copy_tokenizer_files(base, out_dir)
    return str(out_dir)
