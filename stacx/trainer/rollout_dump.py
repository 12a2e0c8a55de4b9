"""Rollout dumps: every step's training batch as it reached the trainer, written to a folder and trained
from again without an engine, a sandbox or a reward (docs/rollout_dumps.md).

    --dump-rollouts DIR      the driver writes DIR/step_000000003.pt after collecting rollout step 3
    --replay-rollouts DIR    the driver reads DIR/step_000000003.pt instead of collecting step 3

A step file is one `torch.save` of plain values (tensors, lists, numbers, strings, None), written to a
temporary sibling and renamed into place, so a reader never sees half a file and `torch.load(weights_only=True)`
reads it (a file holding anything else is refused, never unpickled). The batch is taken before the
trainer adds anything (reference and old log-probs, injected values, advantages): replaying it runs the
same forwards, advantage estimator and optimizer steps on the same samples, so on the deterministic CPU
path the losses and weights equal the dumped run's bitwise.

    writer = RolloutDumpWriter(folder, recipe="grpo", seed=1234)
    writer.write(step, batch, metrics, samples)            # samples: the rollout's, for their versions
    batch, metrics = RolloutReplay(folder).read(step)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from stacx.trainer.batch import StepBatch

logger = logging.getLogger(__name__)

DUMP_FORMAT = 1
"""Version of the step-file layout below; a reader refuses another."""
MANIFEST_NAME = "dump.json"
"""The folder's manifest: format, recipe, seed, the run config's train section (written once)."""

TRAINER_FILLED_FIELDS = ("log_probs", "ref_log_probs", "advantages", "values", "returns")
"""StepBatch fields the trainer computes after the batch arrives; a dump never holds them (the replay
recomputes them from the same samples)."""


def step_file_name(step: int) -> str:
    """`step_000000003.pt`: rollout step 3 (the `rollout_step` of metrics.jsonl, counted from 0)."""
    return f"step_{step:09d}.pt"


class RolloutDumpError(RuntimeError):
    """A dump folder or step file is missing, of another format, or holds what may not be unpickled."""


def batch_fields(batch: StepBatch) -> dict[str, Any]:
    """The batch's set fields by name (the trainer-filled ones left out): per-sample tensors packed into
    one tensor each (`pack`), scalars as plain lists."""
    return {f.name: pack(list(value)) for f in dataclasses.fields(batch)
            if f.name not in TRAINER_FILLED_FIELDS and (value := getattr(batch, f.name)) is not None}


def pack(values: list) -> Any:
    """One tensor per sample -> {"packed": the samples' tensors concatenated along dim 0, "lengths": each
    sample's dim-0 size}: a step file of a few tensors instead of one per sample and field is about 30x
    faster to write and read (docs/performance.md). Anything else stays the list it is."""
    tensors = all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values)
    if not values or not tensors or len({(v.dtype, tuple(v.shape[1:])) for v in values}) != 1:
        return values
    return {"packed": torch.cat(values), "lengths": [int(v.shape[0]) for v in values]}


def unpack(value: Any) -> list:
    """The per-sample list again (`pack`'s inverse); each tensor its own copy, not a view of the packed one."""
    if isinstance(value, dict) and "packed" in value:
        return [piece.clone() for piece in torch.split(value["packed"], list(value["lengths"]))]
    return list(value)


def sample_info(samples: Optional[Sequence[Any]]) -> dict[str, list]:
    """Per sample, what the batch drops but a reader of the dump wants: the weight version (the oldest of
    its tokens), per-token versions when the rollout recorded them (async and agent rollouts), the finish
    reason. Not read by the replay."""
    if not samples:
        return {}
    return {
        "weight_version": [int(getattr(s, "weight_version", 0)) for s in samples],
        "token_versions": [_token_versions(s) for s in samples],
        "finish_reason": [str(getattr(s, "finish_reason", "")) for s in samples],
    }


def _token_versions(sample: Any) -> Optional[list[int]]:
    versions = (getattr(sample, "metadata", None) or {}).get("token_versions")
    return [int(v) for v in versions] if versions is not None else None


def _plain_metrics(metrics: dict) -> dict[str, float]:
    return {str(key): float(value) for key, value in metrics.items() if isinstance(value, (int, float))}


def _write_atomically(path: Path, payload: Any) -> int:
    """torch.save into a temporary sibling, fsync, rename into place; returns the file's size."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    return path.stat().st_size


class RolloutDumpWriter:
    """Writes one step file per collected step into `folder` (the driver; created when missing)."""

    def __init__(self, folder: str | os.PathLike, *, recipe: str, seed: int, train_section: Optional[dict] = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.seconds = 0.0
        """Time spent writing step files so far (the dump's cost, docs/performance.md)."""
        self.bytes = 0
        """Bytes of the step files written so far."""
        manifest = {"format": DUMP_FORMAT, "recipe": recipe, "seed": seed, "train": train_section or {}}
        (self.folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, default=str) + "\n")

    def write(self, step: int, batch: StepBatch, metrics: dict,
              samples: Optional[Sequence[Any]] = None) -> tuple[float, int]:
        """Write rollout step `step`'s file; returns (seconds it took, its bytes), logged as the step's
        `time/rollout_dump_s` and `rollout_dump/bytes`."""
        started = time.perf_counter()
        payload = {"format": DUMP_FORMAT, "step": step, "fields": batch_fields(batch),
                   "samples": sample_info(samples), "metrics": _plain_metrics(metrics)}
        size = _write_atomically(self.folder / step_file_name(step), payload)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        self.bytes += size
        return seconds, size


class RolloutReplay:
    """Reads a dump's step files back as (StepBatch, rollout metrics), for `--replay-rollouts`."""

    def __init__(self, folder: str | os.PathLike, *, recipe: Optional[str] = None):
        self.folder = Path(folder)
        manifest_path = self.folder / MANIFEST_NAME
        if not manifest_path.is_file():
            raise RolloutDumpError(f"--replay-rollouts {folder}: no {MANIFEST_NAME} there; give the folder a run "
                                   "wrote with --dump-rollouts")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != DUMP_FORMAT:
            raise RolloutDumpError(f"--replay-rollouts {folder}: dump format {self.manifest.get('format')!r}, this "
                                   f"Stacx reads format {DUMP_FORMAT}; dump it again with this version")
        if recipe is not None and self.manifest.get("recipe") not in (None, recipe):
            logger.warning("--replay-rollouts %s was dumped by a %s run and is replayed by %s: the batch fields the "
                           "new recipe reads must be in the dump", folder, self.manifest.get("recipe"), recipe)

    def steps(self) -> list[int]:
        """The rollout steps the dump holds, in order."""
        found = []
        for path in self.folder.glob("step_*.pt"):
            digits = path.stem.removeprefix("step_")
            if digits.isdigit():
                found.append(int(digits))
        return sorted(found)

    def read(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        path = self.folder / step_file_name(step)
        if not path.is_file():
            held = self.steps()
            span = f"steps {held[0]}..{held[-1]}" if held else "no steps"
            raise RolloutDumpError(f"--replay-rollouts {self.folder} has no {path.name} for rollout step {step} (it "
                                   f"holds {span}); give --num-steps {held[-1] + 1 if held else 0} or fewer, or a "
                                   "dump of a longer run")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise RolloutDumpError(f"--replay-rollouts: {path} holds an object that may not be unpickled "
                                   f"(torch.load(weights_only=True) refused it: {str(err).splitlines()[0]}); a "
                                   "rollout dump holds tensors and plain values only") from None
        if not isinstance(payload, dict) or payload.get("format") != DUMP_FORMAT:
            raise RolloutDumpError(f"--replay-rollouts: {path} is not a format-{DUMP_FORMAT} rollout step file")
        # The rollout's own metrics describe the replayed samples; its timings were the original run's.
        metrics = {key: value for key, value in (payload.get("metrics") or {}).items() if not key.startswith("time/")}
        return StepBatch(**{name: unpack(value) for name, value in payload["fields"].items()}), metrics

