"""Model and optimizer state in megatron-core's `torch_dist` distributed-checkpoint format.

    save_torch_dist(folder, model, optimizer)        # every rank of the model's world, at once
    load_torch_dist(folder, model, optimizer)        # any (tp, cp, dp) layout the model allows

The folder is what `megatron.core.dist_checkpointing.save` writes from `sharded_state_dict()`:
    metadata.json             {"sharded_backend": "torch_dist", ...}    written last
    .metadata                 PyTorch DCP metadata: every tensor's global shape and chunks
    common.pt                 non-tensor state (optimizer param groups), rank 0
    __<rank>_<n>.distcp       each rank's chunks of the global tensors

Tensors are stored by global shape and offset, so a folder saved at one layout loads at another:
each rank reads exactly the rows/columns of its new shard. The vocab-parallel tensors (embedding,
output layer) are padded to a multiple of tp (`padded_vocab_size`), so their global shape changes
with tp; megatron marks them `allow_shape_mismatch` and loads the overlapping rows, and the
padding rows come back as zeros (they are never read: logits beyond the real vocab are masked).

The optimizer (megatron's FP32Optimizer / Float16Optimizer / a ChainedOptimizer of one, never a
distributed optimizer in Stacx) maps each Adam moment onto its parameter's sharding
(`optimizer.sharded_state_dict(model_sharded_state_dict)`), so it reshards with the weights.

Saving runs `FullyParallelSaveStrategyWrapper` over DP x CP: replicas split the writing instead of
leaving it all to the first replica. Every call here is collective over the default process group.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stacx.parallel.groups import ProcessGroups

TORCH_DIST_BACKEND = "torch_dist"
METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_STATE = "common.pt"
OPTIMIZER_PREFIX = "optimizer."
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")
"""Optimizer tensors: `optimizer.` or, for megatron's chain of several optimizers (a mixture-of-experts model
keeps its routed experts in an optimizer of their own, at every ep: `trainer.runtime.optim`),
`chained_<i>.optimizer.`."""


def is_optimizer_key(key: str) -> bool:
    return bool(_OPTIMIZER_KEY.match(key))


class TorchDistCheckpointError(RuntimeError):
    """A torch_dist folder is missing, incomplete, corrupt, or does not fit the model."""


def is_torch_dist_folder(path: str | os.PathLike) -> bool:
    """Whether `path` holds a complete torch_dist checkpoint (metadata.json naming the backend, .metadata)."""
    folder = Path(path)
    try:
        backend = json.loads((folder / METADATA_JSON).read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return False
    return backend == TORCH_DIST_BACKEND and (folder / DCP_METADATA).is_file()


def model_sharded_state_dict(model) -> dict[str, Any]:
    """megatron's sharded state dict of the GPTModel inside `model` (DDP unwrapped), keys as megatron names them;
    of a list of model chunks (virtual pipeline stages), {"chunk<i>": chunk i's}. The files key each tensor by
    its name and global layer range only, so either form reads what the other wrote."""
    from stacx.models.builder import model_chunks, unwrap_model

    if not isinstance(model, (list, tuple)):
        return unwrap_model(model).sharded_state_dict()
    return {f"chunk{index}": unwrap_model(chunk).sharded_state_dict() for index, chunk in enumerate(model_chunks(model))}


def _load_model_state(model, state: dict[str, Any]) -> None:
    from stacx.models.builder import model_chunks, unwrap_model

    if not isinstance(model, (list, tuple)):
        unwrap_model(model).load_state_dict(state, strict=False)
        return
    for index, chunk in enumerate(model_chunks(model)):
        unwrap_model(chunk).load_state_dict(state[f"chunk{index}"], strict=False)


def _save_strategy(groups: ProcessGroups):
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy(TORCH_DIST_BACKEND)
    if groups is not None and groups.dp_cp_size > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, groups.dp_cp)
    return strategy


def _use_in_process_results_queue() -> None:
    """A synchronous save runs megatron's writer in this process, so its results queue need not be a
    `multiprocessing.Manager` queue, whose server process (a fresh interpreter, spawned on the first
    save) costs seconds and cannot start inside a daemonic process. Asynchronous saves are not used."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _full_sharded_state_dict(model, optimizer, *, is_loading: bool) -> dict[str, Any]:
    model_state = model_sharded_state_dict(model)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return state


def save_torch_dist(folder: str | os.PathLike, model, optimizer=None, *, groups: ProcessGroups | None = None) -> list[str]:
    """Write `model`'s weights (and `optimizer`'s state) into `folder` as torch_dist; collective.

    `groups` (the model's ProcessGroups) lets DP x CP replicas share the writing. Returns the files
    this rank wrote (its `__<rank>_*.distcp`; rank 0 also metadata.json, .metadata and common.pt),
    paths relative to `folder`, so each rank can report and hash its own.
    """
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _full_sharded_state_dict(model, optimizer, is_loading=False)
    _use_in_process_results_queue()
    dist_checkpointing.save(state, str(folder), sharded_strategy=_save_strategy(groups))
    return files_written_by_rank(folder, dist.get_rank())


def files_written_by_rank(folder: str | os.PathLike, rank: int) -> list[str]:
    """The files of a torch_dist `folder` that global rank `rank` wrote (relative paths, sorted)."""
    folder = Path(folder)
    own = [Path(p).name for p in glob.glob(str(folder / f"__{rank}_*.distcp"))]
    if rank == 0:
        own += [name for name in (METADATA_JSON, DCP_METADATA, COMMON_STATE) if (folder / name).is_file()]
    return sorted(own)


def _require_complete(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise TorchDistCheckpointError(f"{what} {folder}: folder not found")
    if not is_torch_dist_folder(folder):
        raise TorchDistCheckpointError(
            f"{what} {folder}: not a complete torch_dist checkpoint (expected {METADATA_JSON} naming "
            f"sharded_backend {TORCH_DIST_BACKEND!r} and {DCP_METADATA}); it was cut short or is another format")


def _checkpoint_keys(folder: Path) -> set[str]:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return set(load_tensors_metadata(str(folder)))


def _checkpoint_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor of torch_dist `folder`: its global shape."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return {key: tuple(tensor.global_shape) for key, tensor in load_tensors_metadata(os.fspath(folder)).items()}


LANGUAGE_MODEL_HEAD = "output_layer."
"""The keys of the language-model head, which a critic's value head replaces (`stacx.checkpointing.value_head`)."""


def _without_language_model_head(model_state: dict[str, Any]) -> dict[str, Any]:
    """A model's sharded state dict (or {"chunk<i>": ...}) without the language-model head's tensors."""
    return {key: (_without_language_model_head(value) if isinstance(value, dict) else value)
            for key, value in model_state.items() if not key.startswith(LANGUAGE_MODEL_HEAD)}


@torch.no_grad()
def load_torch_dist(folder: str | os.PathLike, model, optimizer=None, *, what: str = "checkpoint",
                    strict_model: bool = True, value_head: bool = False) -> bool:
    """Read `folder` into `model` (and `optimizer`) at this run's layout, resharding as needed; collective.

    Returns whether the optimizer state was loaded: False when `optimizer` is given but the folder holds
    no optimizer state (a reference model or a converted Hugging Face checkpoint). Every model tensor
    must be in the folder (else TorchDistCheckpointError naming the first missing key); extra tensors
    (another model's optimizer, for instance) are ignored. A file that fails to read is named. `value_head`: the
    model is a critic's decoder, loaded without its language-model head (which a value head replaces; read it with
    `stacx.checkpointing.value_head`); only without an optimizer.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    folder = Path(folder)
    _require_complete(folder, what)
    saved_keys = _checkpoint_keys(folder)
    has_optimizer = any(is_optimizer_key(key) for key in saved_keys)
    with_optimizer = optimizer if (optimizer is not None and has_optimizer) else None
    if with_optimizer is not None:
        _require_same_optimizer_chain(saved_keys, with_optimizer, folder, what)
    state = _full_sharded_state_dict(model, with_optimizer, is_loading=True)
    if value_head:
        if with_optimizer is not None:
            raise ValueError("load_torch_dist: value_head=True reads start weights only, without an optimizer")
        state["model"] = _without_language_model_head(state["model"])
    try:
        loaded, missing, _unexpected = dist_checkpointing.load(
            state, str(folder), strict=StrictHandling.RETURN_ALL)
    except TorchDistCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - DCP and megatron raise many types; name the folder
        raise TorchDistCheckpointError(f"{what} {folder}: reading failed ({type(err).__name__}: {err})") from err
    missing_model = sorted(key for key in missing if not is_optimizer_key(key)
                           and not (value_head and key.startswith(LANGUAGE_MODEL_HEAD)))
    if missing_model and strict_model and all(key.endswith((".lora_a", ".lora_b")) for key in missing_model):
        raise TorchDistCheckpointError(
            f"{what} {folder} holds LoRA adapters ({missing_model[0]!r}, {len(missing_model)} in all) that this "
            "model does not have: it is the role of a run trained with --lora-rank. Export it merged first "
            "(`stacx convert checkpoint-to-hf --load STEP --role ROLE --lora merged --out DIR`) and pass DIR")
    if missing_model and strict_model:
        raise TorchDistCheckpointError(
            f"{what} {folder} has no tensor {missing_model[0]!r} that the model needs"
            + (f" (and {len(missing_model) - 1} more)" if len(missing_model) > 1 else "")
            + "; it was saved from another architecture or config")
    _load_model_state(model, loaded["model"])
    if with_optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return with_optimizer is not None


def _require_same_optimizer_chain(saved_keys: set[str], optimizer, folder: Path, what: str) -> None:
    """megatron stores a chain of several optimizers under `chained_<i>.` keys and one optimizer without them;
    the two layouts do not convert into each other (their non-tensor state differs in structure). Stacx gives a
    mixture-of-experts model the chain (dense, experts) at every ep, so the state reshards across ep; only a
    checkpoint of an MoE run at ep = 1 by an earlier Stacx, which built one optimizer there, differs."""
    saved_chained = any(key.startswith("chained_") for key in saved_keys if is_optimizer_key(key))
    chained = len(getattr(optimizer, "chained_optimizers", None) or [optimizer]) > 1
    if saved_chained != chained:
        raise TorchDistCheckpointError(
            f"{what} {folder}: its optimizer state was saved as {'a chain of' if saved_chained else 'one'} "
            f"optimizer{'s' if saved_chained else ''}, this run has {'a chain' if chained else 'one'}. Stacx keeps "
            "a mixture-of-experts model's routed experts in an optimizer of their own at every "
            "--expert-model-parallel-size; a checkpoint written by an earlier Stacx at "
            "--expert-model-parallel-size 1 built one optimizer. Its weights load at any size: start a new run "
            "from them (stacx convert checkpoint-to-hf, then --hf-checkpoint) instead of resuming with --load")


__all__ = [
    "COMMON_STATE",
    "DCP_METADATA",
    "METADATA_JSON",
    "TORCH_DIST_BACKEND",
    "TorchDistCheckpointError",
    "files_written_by_rank",
    "is_torch_dist_folder",
    "load_torch_dist",
    "model_sharded_state_dict",
    "save_torch_dist",
]
