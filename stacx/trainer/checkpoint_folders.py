"""The folder a run saves into (`--save`): its complete checkpoints (`step_*` folders with a manifest),
the staging folders of saves not yet committed, and the rules for reusing it.

A checkpoint's own format (what a step folder holds, writing and loading it) is `stacx.trainer.checkpoint`;
this module only finds, lists, prunes and removes whole folders, and reads a step folder's manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
"""Written last into a step folder: a folder without it is no complete checkpoint."""
STAGING_PREFIX = ".staging-"
"""A save in progress: `<root>/.staging-step_<STEP>-<pid>-<unique>/`, renamed to `step_<STEP>` at commit."""
_STEP_DIR = re.compile(r"^step_(\d{9,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the resuming run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def remove_staging_folders(root: str | os.PathLike, *, pid: int | None = None) -> list[str]:
    """Delete the staging folders that process `pid` (default: this one) began under `root` and never
    committed (an interrupted save); returns what went. Other processes' folders are left alone."""
    root = Path(root)
    if not root.is_dir():
        return []
    marker = f"-{os.getpid() if pid is None else pid}-"
    removed = [str(entry) for entry in root.iterdir()
               if entry.name.startswith(STAGING_PREFIX) and marker in entry.name and entry.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


STALE_STAGING_QUIET_S = 300.0
"""Seconds without a write after which another process's staging folder counts as abandoned. A save
writes its files one after another, so a folder that something still writes into is never this quiet;
a killed driver's Ray workers can go on writing their shards into it for minutes, and then stop."""


def _newest_write(folder: Path) -> float:
    """The latest modification time of `folder` and of anything in it (0.0 when it has gone meanwhile)."""
    newest = 0.0
    for parent, dirs, files in os.walk(folder):
        for path in (parent, *(os.path.join(parent, name) for name in dirs + files)):
            try:
                newest = max(newest, os.lstat(path).st_mtime)
            except OSError:  # removed while we looked
                pass
    return newest


def remove_stale_staging_folders(root: str | os.PathLike, *, quiet_s: float = STALE_STAGING_QUIET_S,
                                 now: float | None = None) -> list[str]:
    """Delete the staging folders under `root` that a killed or crashed run left, those in which nothing
    was written for `quiet_s` seconds; returns what went.

    A driver killed with SIGKILL (or a lost node) never runs its teardown, so its `.staging-*` folder
    stays (a container's new driver may even have the same pid); the next run that saves into `root`
    calls this at its start and before each save. A folder that a live save is writing (the workers a
    killed driver left behind, while they still write) is kept, and so is one that holds a manifest
    while its `step_*` folder is missing (a commit cut short between its two renames: a complete
    checkpoint, to be renamed into place by hand).
    Assumes one run at a time saves into a `--save` folder, as `check_save_folder` asks."""
    root = Path(root)
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(STAGING_PREFIX) or not entry.is_dir():
            continue
        match = re.match(rf"^{re.escape(STAGING_PREFIX)}(step_\d{{9,}})-", entry.name)
        if match and (entry / MANIFEST_NAME).is_file() and not (root / match.group(1)).exists():
            continue
        if now - _newest_write(entry) >= quiet_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def check_save_folder(save: str | os.PathLike | None, *, load: str | os.PathLike | None, overwrite: bool) -> None:
    """Refuse to start a run whose --save folder holds another run's checkpoints, unless --load
    resumes from that folder (or a step inside it) or --overwrite allows replacing them."""
    if not save:
        return
    existing = list_checkpoints(save)
    if not existing or overwrite:
        return
    save_path = Path(save).resolve()
    if load:
        load_path = Path(load).resolve()
        if load_path == save_path or load_path.parent == save_path:
            return
    steps = ", ".join(str(step) for step, _ in existing[:5]) + (", ..." if len(existing) > 5 else "")
    raise CheckpointError(
        f"--save {save} already holds checkpoints of another run (steps {steps}); a new run would overwrite "
        f"them. Resume that run with --load {save}, choose another --save folder, or pass --overwrite to "
        "replace them")


def remove_checkpoints(root: str | os.PathLike) -> list[str]:
    """Delete every complete checkpoint under `root` (a run started with --overwrite, at its first save,
    so that an older run's later steps cannot be taken for this run's latest); returns what went."""
    removed = [path for _, path in list_checkpoints(root)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The parsed manifest.json of a step folder; a truncated or unreadable one is named with its path."""
    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the checkpoint is truncated or corrupt. Resume "
                              "from an earlier step folder with --load, or delete this one") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(manifest).__name__}")
    return manifest


def resolve_checkpoint_folder(path: str | os.PathLike) -> Path:
    """`path` itself when it is a step folder (has a manifest), else the newest complete one under it."""
    folder = Path(path)
    if not (folder / MANIFEST_NAME).is_file():
        latest = latest_checkpoint(folder)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint (a step_* folder with {MANIFEST_NAME}) under {folder}")
        folder = Path(latest)
    return folder


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, str]]:
    """(step, folder) of every complete checkpoint under `root`, oldest first; staging folders are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST_NAME).is_file():
            found.append((int(match.group(1)), str(entry)))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The folder of the newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints and any stale staging folders; returns what went."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    removed = [path for _, path in list_checkpoints(root)[:-keep_last]]
    removed += [str(entry) for entry in Path(root).iterdir()
                if entry.name.startswith(STAGING_PREFIX) and f"-{os.getpid()}-" not in entry.name]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
