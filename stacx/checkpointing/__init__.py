"""Distributed checkpoints on megatron-core's `dist_checkpointing` (torch_dist), model-folder
detection, and conversions between Hugging Face, torch_dist and training checkpoints.

- `torch_dist`: save/load a model and its optimizer through `sharded_state_dict`; loads reshard
  to the loading run's (tp, cp, dp) layout.
- `folders`: which layout a folder holds (Hugging Face or torch_dist) and loading its weights.
- `convert`: Hugging Face <-> torch_dist at any tp, a training checkpoint's role -> Hugging Face.
"""

from stacx.checkpointing.folders import HF, TORCH_DIST, ModelFolderError, detect_model_folder, load_model_weights
from stacx.checkpointing.torch_dist import (
    TorchDistCheckpointError,
    is_torch_dist_folder,
    load_torch_dist,
    save_torch_dist,
)

__all__ = [
    "HF",
    "TORCH_DIST",
    "ModelFolderError",
    "TorchDistCheckpointError",
    "detect_model_folder",
    "is_torch_dist_folder",
    "load_model_weights",
    "load_torch_dist",
    "save_torch_dist",
]
