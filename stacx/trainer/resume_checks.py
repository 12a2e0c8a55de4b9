"""What a resume (--load of a training checkpoint) must agree on with the checkpoint, checked before
anything starts (preflight, so `--dry-run` too) instead of after the workers loaded it:

- --num-steps is not below the checkpoint's step (a resumed run trains from that step to --num-steps);
- the split of a rollout into optimizer steps is the checkpoint's own (--global-batch-size,
  --num-steps-per-rollout, --num-epochs): its LR schedule and optimizer state count its optimizer steps;
- in async mode, the generated but untrained groups the checkpoint holds can still be trained under this
  run's --max-staleness and --rollout-batch-size (`check_restorable`, what the scheduler checks itself).

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


def saved_train_and_rollout(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `train` and `rollout` sections of the run config saved with the checkpoint ({} when unreadable)."""
    try:
        saved = json.loads((folder / RUN_CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return {}, {}
    if not isinstance(saved, dict):
        return {}, {}
    return (saved.get("train") if isinstance(saved.get("train"), dict) else {},
            saved.get("rollout") if isinstance(saved.get("rollout"), dict) else {})


def check_resume(run_config: RunConfig) -> None:
    """Every check of the module doc (nothing without a training checkpoint to resume)."""
    found = resumed_checkpoint(run_config)
    if found is None:
        return
    folder, manifest = found
    step = int(manifest.get("step", 0))
    load = run_config.model.load
    saved_train, saved_rollout = saved_train_and_rollout(folder)
    num_steps = run_config.train.num_steps
    if num_steps < step:
        raise PreflightError(f"--num-steps {num_steps} is below the step of the checkpoint --load {load} resumes "
                             f"({folder.name}: {step} steps done); a resumed run trains from step {step} to "
                             f"--num-steps, so give --num-steps {step} or more")
    check_resume_split(run_config, folder, saved_train)
    check_resume_staleness(run_config, folder, manifest, step, saved_rollout)


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
