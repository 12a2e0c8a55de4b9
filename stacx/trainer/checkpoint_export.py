"""One role's weights of a training checkpoint (`--save` folder, `step_*`) as a Hugging Face folder.

    base = base_checkpoint_of(step_folder)                        # the run's --hf-checkpoint
    export_role_to_hf(step_folder, "policy", base, out_dir)       # config.json + safetensors

A training checkpoint holds each role's weights in megatron-core torch_dist (`roles/<role>/model/`),
global tensors whatever the TP size it was saved at. The export loads them into a one-process
model and writes Hugging Face safetensors with the vocabulary padding stripped
(`stacx.checkpointing.convert.convert_torch_dist_to_hf`). The config, the tokenizer files
and generation_config.json come from the checkpoint the run started from (`base`), which the run
config records. Both functions check what they read against the manifest's sha256 first.
"""

from __future__ import annotations

import os

from stacx.trainer.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    LoadedCheckpoint,
    read_manifest,
    role_model_folder,
    verify_checkpoint_files,
)


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
    manifest = read_manifest(step_folder)
    verify_checkpoint_files(step_folder, manifest, roles=[], run_config=True)
    loaded = LoadedCheckpoint(path=str(step_folder), manifest=manifest, expected_layouts={})
    base = (loaded.run_config().get("model") or {}).get("hf_checkpoint")
    if not base:
        raise CheckpointError(f"{step_folder}/run_config.json names no model.hf_checkpoint; pass --hf-checkpoint "
                              "with the folder the run started from (its config.json and tokenizer are needed)")
    try:
        return require_hf_checkpoint_folder(base)
    except CheckpointNotFoundError as err:
        raise CheckpointError(f"{err}. The run in {step_folder} started from it and its config.json and tokenizer "
                              "are needed; pass --hf-checkpoint with that folder's new place") from None


def lora_settings_of(step_folder: str | os.PathLike):
    """The LoRA settings the run at `step_folder` trained with (its run_config.json's --lora-* fields), or None."""
    # Imported here: megatron-core is slow to import (start-up time); LoraSettings itself is light.
    from stacx.models.lora import LoraSettings

    loaded = LoadedCheckpoint(path=str(step_folder), manifest=read_manifest(step_folder), expected_layouts={})
    model = loaded.run_config().get("model") or {}
    if int(model.get("lora_rank") or 0) <= 0:
        return None
    return LoraSettings(rank=int(model["lora_rank"]), alpha=float(model.get("lora_alpha", 16.0)),
                        dropout=float(model.get("lora_dropout", 0.0)),
                        target_modules=tuple(model.get("lora_target_modules") or ("all-linear",)),
                        rslora=bool(model.get("lora_rslora", False)),
                        seed=int((loaded.run_config().get("train") or {}).get("seed", 0)))


def role_has_adapters(model_folder: str | os.PathLike) -> bool:
    """Whether a role's torch_dist folder holds LoRA adapters (`...lora_a` tensors)."""
    # Imported here: megatron-core's dist checkpointing is slow to import (start-up time).
    from stacx.checkpointing.folders import resolve_torch_dist_folder
    from stacx.checkpointing.torch_dist import _checkpoint_keys

    keys = _checkpoint_keys(resolve_torch_dist_folder(model_folder, flag="--load"))
    return any(key.endswith(".lora_a") for key in keys)


def export_role_to_hf(step_folder: str | os.PathLike, role: str, base: str, out_dir: str | os.PathLike,
                      lora: str | None = None) -> str:
    """Write `role`'s weights at `step_folder` as a Hugging Face checkpoint in `out_dir`; returns it.

    A role trained with LoRA adapters is written merged (W + s B A) or, with `lora="adapter"`, as a PEFT adapter
    folder for `base` (`stacx.checkpointing.lora_export`). A critic (a value head) is written as its family's
    *ForTokenClassification with one label (`score.weight`, `score.bias`); a critic with adapters merged only."""
    # Imported here: megatron-core's dist checkpointing is slow to import (start-up time).
    from stacx.checkpointing.convert import convert_torch_dist_to_hf

    manifest = read_manifest(step_folder)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {step_folder}: format version {version} (this Stacx reads {FORMAT_VERSION}, "
                              "torch_dist weights); export it with the Stacx version that wrote it")
    # The same check as resuming (`load_checkpoint`): a damaged shard is named, never converted.
    verify_checkpoint_files(step_folder, manifest, roles=[role], model_only=True)
    folder = role_model_folder(step_folder, role)
    if role_has_adapters(folder):
        # Imported here: megatron-core's dist checkpointing is slow to import (start-up time).
        from stacx.checkpointing.lora_export import export_lora_role

        settings = lora_settings_of(step_folder)
        if settings is None:
            raise CheckpointError(f"checkpoint {step_folder}: role {role!r} holds LoRA adapters but its run_config.json "
                                  "has no --lora-rank; the checkpoint is damaged")
        return export_lora_role(folder, out_dir, base, settings, mode=lora or "merged")
    if lora is not None:
        raise CheckpointError(f"--lora {lora}: role {role!r} of {step_folder} holds no LoRA adapters (its run had no "
                              "--lora-rank); drop --lora")
    return convert_torch_dist_to_hf(folder, out_dir, hf_config=base, what="--load")
