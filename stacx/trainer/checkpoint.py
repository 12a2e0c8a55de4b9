"""Crash-safe training checkpoints: every role's per-rank state, the driver's state and the run config.

On-disk layout of one checkpoint (`STEP` is zero-padded so names sort by step):

    <root>/step_000000012/
        manifest.json                 written last: step, recipe, per-role layout, every file with size + sha256
        driver.pt                     the driver's state (data position, driver RNG, counters)
        run_config.json               the resolved run configuration
        roles/<role>/model/           the role's weights and optimizer state, megatron-core torch_dist
                                      (`stacx.checkpointing.torch_dist`): global tensors, any layout loads them
        roles/<role>/rank_00003.pt    one small file per rank: scheduler, RNG state, step count

Writing is split so that no state crosses process boundaries twice:

    staging = begin_checkpoint(root, step)                        # driver
    info = write_rank_state(staging, role, rank, state, coords,   # each Ray worker, in parallel; with
                            model=..., optimizer=..., groups=...) # model, one collective torch_dist save
    commit_checkpoint(staging, step=..., rank_files=[info, ...])  # driver: manifest, then atomic rename

Each rank hashes the torch_dist files it wrote itself (in parallel) and reports them with its own
file, so the manifest lists every file of the checkpoint with its size and sha256.

Until the rename, everything lives in `<root>/.staging-step_000000012-<unique>/`; a crash at any
point leaves either no new checkpoint or a complete one, and `latest_checkpoint` only sees
complete ones (a `step_*` folder with a manifest). A run's teardown removes its own unfinished
staging folder (`remove_staging_folders`); a killed run's is removed by the next run into the
folder once nothing writes into it any more (`remove_stale_staging_folders`). `load_checkpoint`
checks the recipe and verifies every file against the manifest (a corrupt one is named); every
other reader checks what it reads the same way (`verify_checkpoint_files`: the export, a role's
model folder given as a start or reference checkpoint). The model state loads at any (tp, cp, dp)
layout the model allows, and so does the optimizer state: megatron maps each Adam moment onto its
parameter's sharding, so both reshard together. The per-rank RNG state is restored exactly when
the layout is unchanged (resume is then bitwise exact); after a layout
change each rank takes the RNG state of the saved rank at the same grid position, or rank 0's.

Stacx's own `.pt` files are read with `torch.load(weights_only=True)` (tensors and plain Python
values; `CHECKPOINT_SAFE_GLOBALS` lists what else is allowed, nothing today), and a file holding
anything else, e.g. a planted pickle payload, is refused with a `CheckpointError` naming it
(`load_state_file`). The torch_dist folder's `common.pt` is read the same way by torch's default,
but its `.metadata` is PyTorch DCP's own pickle: resume only from checkpoints you trust. A matching
sha256 in the manifest proves nothing against someone who can write the folder, since they can
rewrite the manifest too.

Finding, listing, pruning and removing whole step and staging folders is `stacx.trainer.checkpoint_folders`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

# The --save folder's rules (list, prune, staging clean-up), re-exported: callers name the checkpoint API as one.
from stacx.trainer.checkpoint_folders import (
    MANIFEST_NAME,
    STAGING_PREFIX,
    CheckpointError,
    check_save_folder,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_manifest,
    remove_checkpoints,
    remove_stale_staging_folders,
    remove_staging_folders,
    resolve_checkpoint_folder,
    step_dir_name,
)
from stacx.trainer.config.layout import RankCoords, RoleLayout
from stacx.trainer.config.recipe import TrainingConfig, role_checkpoint_path
from stacx.trainer.config.run import ModelSection

FORMAT_VERSION = 2
"""2: weights and optimizer state in torch_dist (`roles/<role>/model/`); 1: one torch.save pickle per rank."""
MODEL_DIR_NAME = "model"
DRIVER_STATE_NAME = "driver.pt"
RUN_CONFIG_NAME = "run_config.json"


@dataclass(frozen=True, kw_only=True)
class FileInfo:
    """One written file, relative to the checkpoint folder."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class RankFileInfo:
    """What a worker reports back after `write_rank_state` (small; sent to the driver over Ray)."""

    role: str
    rank: int
    coords: RankCoords
    file: FileInfo
    model_files: tuple[FileInfo, ...] = ()
    """The torch_dist files of the role's model folder this rank wrote (paths relative to the checkpoint)."""


# ---- RNG state -----------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states, as plain tensors and tuples."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional for Stacx itself
        pass
    else:
        kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "position": int(position),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`: the next random draws repeat those made after the capture."""
    random.setstate(_as_python_random_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np  # numpy is optional for Stacx (see capture_rng_state)

        numpy_state = state["numpy"]
        np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype("uint32"),
                             numpy_state["position"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_random_state(value: Any) -> tuple:
    # torch.load may hand the nested tuples back as lists; random.setstate needs tuples.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


# ---- writing -------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    # Makes renames and new entries in `path` durable (no-op where directories cannot be opened).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write) -> FileInfo:
    """Write through `write(file)` into a temporary sibling, fsync, then rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return FileInfo(path=path.name, size=path.stat().st_size, sha256=_sha256(path))


def begin_checkpoint(root: str | os.PathLike, step: int) -> str:
    """Create and return a fresh staging folder under `root` for checkpoint `step` (driver side)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
    staging = Path(root) / f"{STAGING_PREFIX}{step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    return str(staging)


def role_model_folder(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """The torch_dist folder holding `role`'s weights and optimizer state inside a checkpoint (or staging) folder."""
    return Path(checkpoint_dir) / "roles" / role / MODEL_DIR_NAME


def write_rank_state(staging_dir: str | os.PathLike, role: str, rank: int, state: Mapping[str, Any],
                     coords: RankCoords | None = None, *, model=None, optimizer=None, groups=None) -> RankFileInfo:
    """Write one rank's state into the staging folder (worker side).

    `state` (scheduler, rng, step count, ...) goes into the rank's own `.pt` file. With `model`, the
    model's weights and `optimizer`'s state go into the role's torch_dist folder: a collective save
    that every rank of the role's world must enter at once (`groups` lets DP x CP replicas share the
    writing); each rank then hashes the files it wrote. `coords` places the rank in its role's
    (tp, cp, dp) grid; without it the rank is taken as (tp=0, cp=0, dp=rank).
    """
    staging = Path(staging_dir)
    if not staging.is_dir() or not staging.name.startswith(STAGING_PREFIX):
        raise CheckpointError(f"{staging} is not a staging folder made by begin_checkpoint")
    coords = coords or RankCoords(tp_rank=0, cp_rank=0, dp_rank=rank)
    model_files: tuple[FileInfo, ...] = ()
    if model is not None:
        from stacx.checkpointing.torch_dist import save_torch_dist  # megatron-core's dist checkpointing: start-up time

        folder = role_model_folder(staging, role)
        written = save_torch_dist(folder, model, optimizer, groups=groups)
        model_files = tuple(_file_info(folder / name, staging) for name in written)
    relative = Path("roles") / role / f"rank_{rank:05d}.pt"
    info = _write_atomically(staging / relative, lambda f: torch.save(dict(state), f))
    return RankFileInfo(role=role, rank=rank, coords=coords,
                        file=FileInfo(path=relative.as_posix(), size=info.size, sha256=info.sha256),
                        model_files=model_files)


def _file_info(path: Path, base: Path) -> FileInfo:
    return FileInfo(path=path.relative_to(base).as_posix(), size=path.stat().st_size, sha256=_sha256(path))


def _to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):  # e.g. AlgorithmConfig.given_keys
        return sorted(_to_jsonable(v) for v in value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise CheckpointError(f"run config value {value!r} of type {type(value).__name__} cannot be saved as JSON")


def commit_checkpoint(
    staging_dir: str | os.PathLike,
    *,
    step: int,
    recipe: str | TrainingConfig,
    role_layouts: Mapping[str, RoleLayout],
    rank_files: list[RankFileInfo],
    driver_state: Mapping[str, Any],
    resolved_run_config: Any,
) -> str:
    """Write the driver state, run config and manifest into the staging folder, then rename it to its
    final `step_*` name (atomic on one filesystem). Returns the final folder. Every rank of every role
    in `role_layouts` must have reported a file. Given a TrainingConfig, the manifest also records the
    recipe's full structure, which `load_checkpoint` compares on resume."""
    staging = Path(staging_dir)
    expected_name = step_dir_name(step)
    if not staging.name.startswith(f"{STAGING_PREFIX}{expected_name}-"):
        raise CheckpointError(f"staging folder {staging.name} was not begun for step {step}")
    roles: dict[str, Any] = {}
    for role, layout in role_layouts.items():
        reported = sorted((info for info in rank_files if info.role == role), key=lambda info: info.rank)
        ranks = [info.rank for info in reported]
        if ranks != list(range(layout.world_size)):
            raise CheckpointError(
                f"role {role!r}: expected files from ranks 0..{layout.world_size - 1} ({layout.describe()}), "
                f"got ranks {ranks}"
            )
        roles[role] = {
            "layout": layout.to_dict(),
            "ranks": [{"rank": info.rank, **dataclasses.asdict(info.coords), **dataclasses.asdict(info.file),
                       "model_files": [dataclasses.asdict(f) for f in info.model_files]}
                      for info in reported],
        }
        if any(info.model_files for info in reported):
            from stacx.checkpointing.torch_dist import is_torch_dist_folder  # start-up time (megatron-core)

            if not is_torch_dist_folder(role_model_folder(staging, role)):
                raise CheckpointError(f"role {role!r}: the torch_dist save of {role_model_folder(staging, role)} "
                                      "did not complete (no metadata.json)")
    unknown = sorted({info.role for info in rank_files} - set(role_layouts))
    if unknown:
        raise CheckpointError(f"rank files of roles {unknown} have no layout in role_layouts")
    for info in rank_files:
        for file in (info.file, *info.model_files):
            on_disk = staging / file.path
            if not on_disk.is_file() or on_disk.stat().st_size != file.size:
                raise CheckpointError(f"role {info.role!r} rank {info.rank}: {file.path} is missing or truncated")

    driver = _write_atomically(staging / DRIVER_STATE_NAME, lambda f: torch.save(dict(driver_state), f))
    config_bytes = json.dumps(_to_jsonable(resolved_run_config), indent=2, sort_keys=True).encode()
    run_config = _write_atomically(staging / RUN_CONFIG_NAME, lambda f: f.write(config_bytes))
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "recipe": recipe.name if isinstance(recipe, TrainingConfig) else recipe,
        "recipe_spec": _to_jsonable(recipe) if isinstance(recipe, TrainingConfig) else None,
        "created_unix": time.time(),
        "roles": roles,
        "driver_state": dataclasses.asdict(driver),
        "run_config": dataclasses.asdict(run_config),
    }
    manifest_bytes = json.dumps(manifest, indent=2).encode()
    _write_atomically(staging / MANIFEST_NAME, lambda f: f.write(manifest_bytes))
    _fsync_dir(staging)

    final = staging.parent / expected_name
    if final.exists():
        # Re-saving a step (e.g. after resuming from it): move the old one aside first, so that a crash
        # between the two renames leaves the older checkpoints intact rather than a mix of two.
        discarded = staging.parent / f"{STAGING_PREFIX}discarded-{expected_name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, discarded)
        os.rename(staging, final)
        shutil.rmtree(discarded, ignore_errors=True)
    else:
        os.rename(staging, final)
    _fsync_dir(staging.parent)
    return str(final)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    recipe: str | TrainingConfig,
    role_layouts: Mapping[str, RoleLayout],
    role_states: Mapping[str, Mapping[int, Mapping[str, Any]]],
    driver_state: Mapping[str, Any],
    resolved_run_config: Any,
    role_coords: Mapping[str, Mapping[int, RankCoords]] | None = None,
) -> str:
    """Single-process convenience: begin, write every `role_states[role][rank]`, commit. Returns the folder."""
    staging = begin_checkpoint(root, step)
    try:
        rank_files = [
            write_rank_state(staging, role, rank, state, (role_coords or {}).get(role, {}).get(rank))
            for role, states in role_states.items()
            for rank, state in states.items()
        ]
        return commit_checkpoint(staging, step=step, recipe=recipe, role_layouts=role_layouts,
                                 rank_files=rank_files, driver_state=driver_state,
                                 resolved_run_config=resolved_run_config)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---- loading -------------------------------------------------------------------------------------


def _same_grid(saved: RoleLayout, expected: RoleLayout) -> bool:
    return (saved.tensor_model_parallel_size, saved.context_parallel_size, saved.pipeline_model_parallel_size,
            saved.data_parallel_size) == (expected.tensor_model_parallel_size, expected.context_parallel_size,
                                          expected.pipeline_model_parallel_size, expected.data_parallel_size)


def _source_entry(entries: list[Mapping[str, Any]], saved: RoleLayout, expected: RoleLayout, rank: int,
                  coords: RankCoords | None) -> Mapping[str, Any] | None:
    """The saved rank file a resuming rank loads its small state (scheduler, RNG) from: its own when the
    layout is unchanged, else the saved rank at the same (tp, cp, dp) position, else the first replica
    of its tp shard, else rank 0's. The weights and optimizer state come from the torch_dist folder,
    which reshards by itself."""
    if _same_grid(saved, expected):
        return next((entry for entry in entries if entry["rank"] == rank), None)
    coords = coords or RankCoords(tp_rank=0, cp_rank=0, dp_rank=rank)
    by_position = {(entry["tp_rank"], entry["cp_rank"], entry["dp_rank"], entry.get("pp_rank", 0)): entry
                   for entry in entries}
    for position in ((coords.tp_rank, coords.cp_rank, coords.dp_rank, coords.pp_rank), (coords.tp_rank, 0, 0, 0)):
        if position in by_position:
            return by_position[position]
    return next((entry for entry in entries if entry["rank"] == 0), None)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A validated checkpoint; rank states are read on demand (each worker reads only its own)."""

    path: str
    manifest: dict[str, Any]
    expected_layouts: dict[str, RoleLayout]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def recipe(self) -> str:
        return self.manifest["recipe"]

    def saved_layout(self, role: str) -> RoleLayout:
        return RoleLayout.from_dict(self.manifest["roles"][role]["layout"])

    @property
    def recipe_spec(self) -> dict[str, Any] | None:
        """The saved recipe's structure (roles, syncs, algorithm defaults) when it was saved from a TrainingConfig."""
        return self.manifest.get("recipe_spec")

    def model_folder(self, role: str) -> Path:
        """`role`'s torch_dist folder (weights and optimizer state)."""
        return role_model_folder(self.path, role)

    def layout_changed(self, role: str) -> bool:
        return not _same_grid(self.saved_layout(role), self.expected_layouts.get(role, self.saved_layout(role)))

    def driver_state(self) -> dict[str, Any]:
        return self._load(self.manifest["driver_state"])

    def run_config(self) -> Any:
        return json.loads((Path(self.path) / RUN_CONFIG_NAME).read_text())

    def rank_state(self, role: str, rank: int, coords: RankCoords | None = None) -> dict[str, Any]:
        """The small per-rank state a resuming rank loads (`_source_entry`: its own file when the layout is
        unchanged). `coords` places the resuming rank (default: tp=0, cp=0, dp=rank)."""
        if role not in self.manifest["roles"]:
            raise CheckpointError(f"checkpoint {self.path} has no role {role!r}; roles: {sorted(self.manifest['roles'])}")
        saved = self.saved_layout(role)
        entry = _source_entry(self.manifest["roles"][role]["ranks"], saved, self.expected_layouts.get(role, saved),
                              rank, coords)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path}: role {role!r} has no file for rank {rank}")
        return self._load(entry)

    def _load(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        return load_state_file(Path(self.path) / entry["path"])


CHECKPOINT_SAFE_GLOBALS: tuple[Any, ...] = ()
"""What a checkpoint file may hold beyond torch.load(weights_only=True)'s defaults: nothing.

Audited for megatron-core 0.16 with Stacx's optimizer (no distributed optimizer): the state of
FP32Optimizer, Float16OptimizerWithFloat16Params and ChainedOptimizer is torch Adam's `state`
(tensors) and `param_groups` (floats, ints, bools, None, tuples; megatron adds `wd_mult`,
`lr_mult`, `max_lr`, `min_lr`, `is_expert_parallel`, `is_decoupled_lr`, `default_config`), plus the
fp16 grad scaler's scale tensor and int trackers and the fp32 main-parameter tensors (the
fp16/bf16 optimizer read from megatron's source: it needs CUDA parameters, so only FP32Optimizer
runs in the CPU tests);
OptimizerParamScheduler's is ints, floats and strings; the data loader's is ints; the RNG state is
ints, tuples, a string and tensors (numpy's key array is saved as a tensor for this reason).
`tests/trainer/test_checkpoint_security.py` checks that a real training checkpoint needs nothing more. A
type added here must be a plain data class whose reconstruction runs no code."""


def load_state_file(path: str | os.PathLike) -> Any:
    """`torch.load(path, weights_only=True)` with `CHECKPOINT_SAFE_GLOBALS` allowed, onto the CPU.

    CheckpointError naming the file when it holds anything else (never unpickled, never run)."""
    try:
        with torch.serialization.safe_globals(list(CHECKPOINT_SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message advises weights_only=False (never an option here); keep only what it refused.
        refused = re.search(r"GLOBAL ([\w.]+)", str(err))
        reason = f"it calls or builds {refused.group(1)}" if refused else "torch.load(weights_only=True) refused it"
        raise CheckpointError(
            f"checkpoint file {path} holds an object that Stacx refuses to unpickle ({reason}); checkpoints hold "
            "only tensors and plain Python values, so this file was not written by Stacx or was altered. Do not "
            "resume from it; use a checkpoint from a trusted source"
        ) from None


def _verify_file(folder: Path, entry: Mapping[str, Any], check_hash: bool, flag: str = "--load") -> None:
    path = folder / entry["path"]
    fix = (f"the checkpoint was changed after its save (a damaged disk, an interrupted copy, an edit). Copy it again "
           f"from where it was written, or give {flag} another step folder")
    if not path.is_file():
        raise CheckpointError(f"{flag}: checkpoint {folder}: {entry['path']} is missing; {fix}")
    if path.stat().st_size != entry["size"]:
        raise CheckpointError(f"{flag}: checkpoint {folder}: {entry['path']} has {path.stat().st_size} bytes, "
                              f"the manifest says {entry['size']}; {fix}")
    if check_hash and _sha256(path) != entry["sha256"]:
        raise CheckpointError(f"{flag}: checkpoint {folder}: {entry['path']} does not match its sha256 in the "
                              f"manifest; {fix}")


def verify_checkpoint_files(folder: str | os.PathLike, manifest: Mapping[str, Any], *, roles=None,
                            model_only: bool = False, run_config: bool | None = None, check_hash: bool = True,
                            flag: str = "--load") -> None:
    """Check the files the manifest of step folder `folder` lists against their size and sha256.

    `roles` limits the check to those roles (default: every role, plus driver.pt and run_config.json);
    `model_only` to their torch_dist files; `run_config` adds run_config.json to a limited check.
    CheckpointError naming `flag`, the file and the fix. Every reader of a checkpoint calls this on
    what it reads before reading it (resume, export, a role's model folder given as a start or
    reference checkpoint)."""
    folder = Path(folder)
    saved_roles = manifest.get("roles", {})
    for name in (saved_roles if roles is None else roles):
        if name not in saved_roles:
            raise CheckpointError(f"{flag}: checkpoint {folder} has no role {name!r}; its roles: {sorted(saved_roles)}")
        for entry in saved_roles[name]["ranks"]:
            if not model_only:
                _verify_file(folder, entry, check_hash, flag)
            for model_file in entry.get("model_files", ()):
                _verify_file(folder, model_file, check_hash, flag)
    if roles is None:
        _verify_file(folder, manifest["driver_state"], check_hash, flag)
    if run_config or (run_config is None and roles is None):
        _verify_file(folder, manifest["run_config"], check_hash, flag)


def checkpoint_of_model_folder(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(step folder, role) when `path` is a role's torch_dist folder inside a training checkpoint
    (`step_*/roles/<role>/model` next to a manifest), else None."""
    folder = Path(path).resolve()
    if folder.name != MODEL_DIR_NAME or folder.parent.parent.name != "roles":
        return None
    step = folder.parent.parent.parent
    return (step, folder.parent.name) if (step / MANIFEST_NAME).is_file() else None


def verify_model_folder(path: str | os.PathLike, *, flag: str, check_hash: bool = True) -> None:
    """When model folder `path` is a role's folder inside a training checkpoint, check its files
    against that checkpoint's manifest (as resuming does); other folders have no manifest to check.
    `check_hash=False` compares sizes only (the preflight's cheap look)."""
    found = checkpoint_of_model_folder(path)
    if found is not None:
        step, role = found
        verify_checkpoint_files(step, read_manifest(step), roles=[role], model_only=True, flag=flag,
                                check_hash=check_hash)


def verify_start_folders(model_section: ModelSection, training_config: TrainingConfig, *,
                         check_hash: bool = True) -> None:
    """`verify_model_folder` on every folder a role starts from or takes its reference from, and on
    --load: run by the driver (by every rank under torchrun) before any worker reads them, and by the
    preflight with `check_hash=False` (sizes: a truncated or missing file is named by --dry-run too)."""
    folders: dict[str, str] = {}  # path -> the first flag naming it (each folder is hashed once)
    for role in training_config.roles:
        for arg in (role.checkpoint_arg, role.reference_checkpoint_arg):
            path = role_checkpoint_path(role, model_section, arg) if arg is not None else None
            if path:
                folders.setdefault(os.fspath(path), "--" + arg.replace("_", "-"))
    if model_section.load:
        folders.setdefault(os.fspath(model_section.load), "--load")
    for path, flag in folders.items():
        verify_model_folder(path, flag=flag, check_hash=check_hash)


def _differences(saved: Any, current: Any, path: str = "", limit: int = 5) -> list[str]:
    """Paths (like 'roles[0].trainable') where two JSON-like values differ, at most `limit`."""
    if isinstance(saved, dict) and isinstance(current, dict):
        found = []
        for key in sorted(set(saved) | set(current)):
            found += _differences(saved.get(key), current.get(key), f"{path}.{key}" if path else key, limit)
        return found[:limit]
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        found = []
        for index, (a, b) in enumerate(zip(saved, current)):
            found += _differences(a, b, f"{path}[{index}]", limit)
        return found[:limit]
    return [] if saved == current else [path or "<root>"]


def load_checkpoint(
    path: str | os.PathLike,
    *,
    expected_recipe: str | TrainingConfig,
    expected_layouts: Mapping[str, RoleLayout],
    verify_hashes: bool = True,
) -> LoadedCheckpoint:
    """Open a checkpoint for resuming (`path` is a `step_*` folder, or a root whose latest one is used).

    Fails with CheckpointError when nothing complete is there, the recipe differs, a role is missing,
    a role's layout cannot be resharded to the expected one, or a file does not match the manifest."""
    folder = resolve_checkpoint_folder(path)
    manifest = read_manifest(folder)
    if manifest.get("format_version") == 1:
        raise CheckpointError(
            f"checkpoint {folder}: format version 1 (one torch.save pickle per rank) was written by an older Stacx; "
            f"this one reads version {FORMAT_VERSION} (torch_dist weights). Resume it with the Stacx version that "
            "wrote it, or start a new run from its exported Hugging Face weights")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {folder}: format version {manifest.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
    expected_name = expected_recipe.name if isinstance(expected_recipe, TrainingConfig) else expected_recipe
    if manifest["recipe"] != expected_name:
        raise CheckpointError(f"checkpoint {folder} was saved by recipe {manifest['recipe']!r}; this run uses "
                              f"{expected_name!r}. Resume with --algorithm {manifest['recipe']} or start fresh")
    if isinstance(expected_recipe, TrainingConfig) and manifest.get("recipe_spec") is not None:
        changed = _differences(manifest["recipe_spec"], _to_jsonable(expected_recipe))
        if changed:
            raise CheckpointError(f"checkpoint {folder}: recipe {expected_name!r} has changed since it was saved "
                                  f"(fields {', '.join(changed)}); resume with the recipe it was saved with")
    missing = sorted(set(expected_layouts) - set(manifest["roles"]))
    if missing:
        raise CheckpointError(f"checkpoint {folder} has no state for roles {missing}; it holds {sorted(manifest['roles'])}")
    verify_checkpoint_files(folder, manifest, check_hash=verify_hashes)
    return LoadedCheckpoint(path=str(folder), manifest=manifest, expected_layouts=dict(expected_layouts))


__all__ = [
    "CheckpointError",
    "FileInfo",
    "LoadedCheckpoint",
    "RankCoords",
    "RankFileInfo",
    "RoleLayout",
    "begin_checkpoint",
    "capture_rng_state",
    "check_save_folder",
    "checkpoint_of_model_folder",
    "commit_checkpoint",
    "load_state_file",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_manifest",
    "remove_checkpoints",
    "remove_stale_staging_folders",
    "remove_staging_folders",
    "resolve_checkpoint_folder",
    "restore_rng_state",
    "role_model_folder",
    "save_checkpoint",
    "verify_checkpoint_files",
    "verify_model_folder",
    "verify_start_folders",
    "write_rank_state",
]
