"""What a resume (--load of a training checkpoint) must agree on with the checkpoint, checked before
anything starts (preflight, so `--dry-run` too) instead of after the workers loaded it:

- --num-steps is not below the checkpoint's step (a resumed run trains from that step to --num-steps);
- the split of a rollout into optimizer steps is the checkpoint's own (--global-batch-size,
  --num-steps-per-rollout, --num-epochs): its LR schedule and optimizer state count its optimizer steps;
- in async mode, the generated but untrained groups the checkpoint holds can still be trained under this
  run's --max-staleness and --rollout-batch-size (`check_restorable`, what the scheduler checks itself);
- the LoRA settings that make the checkpoint's model or its optimizer state (`RESUMED_LORA_FIELDS`) are the
  checkpoint's own: another --lora-alpha or --lora-rslora would resume a different policy (W + s B A with
  another s), another --lora-rank or --lora-target-modules other adapter tensors, and another
  --lora-plus-ratio meets optimizer state whose param groups (and B's learning rate) were built for the
  saved ratio. Changing one means a new run from the checkpoint's adapters, which the message spells out.

    check_resume(run_config)     # raises PreflightError naming the flag, the checkpoint's value and the fix
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from stacx.checkpointing.folders import is_model_folder
from stacx.rollout.asynchronous.async_scheduler import check_restorable
from stacx.trainer.checkpoint import (
    RUN_CONFIG_NAME,
    CheckpointError,
    load_state_file,
    read_manifest,
    resolve_checkpoint_folder,
)
from stacx.trainer.config.checks import PreflightError
from stacx.trainer.config.run import RunConfig

SPLIT_FIELDS = ("global_batch_size", "num_steps_per_rollout", "num_epochs")
"""The train-section fields that split a rollout into optimizer steps."""

RESUMED_LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_rslora", "lora_target_modules", "lora_plus_ratio")
"""The model-section LoRA fields a resume keeps: they define the adapters' tensors, their scale in the policy and
the optimizer's param groups. (--lora-dropout, --lora-sync and --lora-init may change on resume: the first only
regularizes training, the second is how pushes travel, the third is spent once the adapters are loaded.)"""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resumed_checkpoint(run_config: RunConfig) -> Optional[tuple[Path, dict[str, Any]]]:
    """(step folder, manifest) of the training checkpoint --load resumes, or None (no --load, a model
    folder, or nothing readable: `check_resume_and_save` names those)."""
    load = run_config.model.load
    if not load or not os.path.exists(load) or is_model_folder(load):
        return None
    try:
        folder = resolve_checkpoint_folder(load)
        return folder, read_manifest(folder)
    except CheckpointError:
        return None


def saved_sections(folder: Path) -> dict[str, dict[str, Any]]:
    """The sections of the run config saved with the checkpoint, by name ({} for one unreadable or missing)."""
    try:
        saved = json.loads((folder / RUN_CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    return {name: section for name, section in saved.items() if isinstance(section, dict)}


def check_resume(run_config: RunConfig) -> None:
    """Every check of the module doc (nothing without a training checkpoint to resume)."""
    found = resumed_checkpoint(run_config)
    if found is None:
        return
    folder, manifest = found
    step = int(manifest.get("step", 0))
    load = run_config.model.load
    saved = saved_sections(folder)
    saved_train, saved_rollout = saved.get("train", {}), saved.get("rollout", {})
    num_steps = run_config.train.num_steps
    if num_steps < step:
        raise PreflightError(f"--num-steps {num_steps} is below the step of the checkpoint --load {load} resumes "
                             f"({folder.name}: {step} steps done); a resumed run trains from step {step} to "
                             f"--num-steps, so give --num-steps {step} or more")
    check_resume_split(run_config, folder, saved_train)
    check_resume_staleness(run_config, folder, manifest, step, saved_rollout)
    check_resume_lora(run_config, folder, saved.get("model", {}))


def check_resume_split(run_config: RunConfig, folder: Path, saved_train: dict[str, Any]) -> None:
    """A split flag set to another value than the checkpoint's is refused, naming only the flags that
    differ and the checkpoint's own split (which the resumed run keeps)."""
    saved = {name: saved_train.get(name) for name in SPLIT_FIELDS}
    if saved["global_batch_size"] is None or saved["num_steps_per_rollout"] is None:
        return  # a checkpoint written before the split was saved resolved: nothing to compare
    differing = [name for name in SPLIT_FIELDS
                 if getattr(run_config.train, name) is not None and getattr(run_config.train, name) != saved[name]]
    if not differing:
        return
    given = ", ".join(f"{_flag(name)} {getattr(run_config.train, name)}" for name in differing)
    own = ", ".join(f"{_flag(name)} {saved[name]}" for name in SPLIT_FIELDS)
    raise PreflightError(
        f"{given}: the checkpoint --load {run_config.model.load} resumes keeps its own split of a rollout into "
        f"optimizer steps ({own}, saved in {folder / RUN_CONFIG_NAME}), because its LR schedule and optimizer "
        f"state count its own optimizer steps. Drop {' and '.join(_flag(name) for name in differing)} to resume, or "
        "start a new run (another --save, without --load) to train with another split")


def _comparable(name: str, value: Any) -> Any:
    """A LoRA field's value as saved JSON and a run config both compare equal (lists as tuples, numbers as float)."""
    if name == "lora_target_modules":
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if name in ("lora_alpha", "lora_plus_ratio") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _shown(name: str, value: Any) -> str:
    if name == "lora_target_modules":
        return " ".join(f"{_flag(name)} {module}" for module in _comparable(name, value))
    if name == "lora_rslora":
        return _flag(name) if value else f"--no-{_flag(name)[2:]}"
    return f"{_flag(name)} {value:g}" if isinstance(value, float) else f"{_flag(name)} {value}"


def check_resume_lora(run_config: RunConfig, folder: Path, saved_model: dict[str, Any]) -> None:
    """A `RESUMED_LORA_FIELDS` value other than the checkpoint's is refused, naming both values and the two ways on:
    resume with the checkpoint's value, or start a new run from its adapters (exported as a PEFT folder)."""
    saved_rank = saved_model.get("lora_rank")
    if not saved_rank:
        return  # a full fine-tuning checkpoint (or one saved before LoRA): torch_dist's load names a mismatch
    differing = [name for name in RESUMED_LORA_FIELDS if name in saved_model
                 and _comparable(name, getattr(run_config.model, name)) != _comparable(name, saved_model[name])]
    if not differing:
        return
    given = ", ".join(f"{_shown(name, getattr(run_config.model, name))} (the checkpoint's: "
                      f"{_shown(name, saved_model[name])})" for name in differing)
    load = run_config.model.load
    if differing == ["lora_plus_ratio"]:
        # The policy is the same under the new ratio: the adapters themselves can start a new run.
        new_run = (f"start a new run from its adapters: `stacx convert checkpoint-to-hf --load {folder} --lora adapter "
                   "--out DIR`, then `stacx train --load DIR` with the new ratio and a new --save (fresh optimizer "
                   "state and schedule)")
    else:
        # A PEFT folder must match the run's rank, alpha and scaling: the merged model is the new start.
        new_run = (f"start a new run from its merged policy: `stacx convert checkpoint-to-hf --load {folder} --lora "
                   "merged --out DIR`, then `stacx train --hf-checkpoint DIR` with the new settings and a new --save")
    raise PreflightError(
        f"{given}: the checkpoint --load {load} resumes was trained with its own LoRA settings (saved in "
        f"{folder / RUN_CONFIG_NAME}); its adapters' tensors, their scale in the policy and the optimizer's param "
        f"groups belong to them, so a resume keeps them. Drop {' and '.join(_flag(name) for name in differing)} "
        f"(or give the checkpoint's value) to resume, or {new_run} (docs/lora.md)")


def check_resume_staleness(run_config: RunConfig, folder: Path, manifest: dict[str, Any], step: int,
                           saved_rollout: dict[str, Any]) -> None:
    """An async checkpoint's untrained groups fit this run's --max-staleness and --rollout-batch-size."""
    rollout = run_config.rollout
    if rollout.rollout_mode != "async" or "driver_state" not in manifest:
        return
    try:
        driver_state = load_state_file(folder / manifest["driver_state"]["path"])
    except (CheckpointError, OSError, KeyError, TypeError):
        return  # resuming names an unreadable driver state itself
    scheduler = ((driver_state or {}).get("async") or {}).get("scheduler") or {}
    groups = list(scheduler.get("groups", ()))
    if not groups:
        return
    try:
        check_restorable([group["admit_version"] for group in groups], train_version=step,
                         max_staleness=rollout.max_staleness, groups_per_step=rollout.rollout_batch_size)
    except ValueError as err:
        written = ", ".join(f"{_flag(name)} {saved_rollout[name]}" for name in ("max_staleness", "rollout_batch_size")
                            if name in saved_rollout)
        raise PreflightError(f"--load {run_config.model.load}: {err}" + (f" ({written})" if written else "")) from None
