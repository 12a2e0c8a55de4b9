"""A LoRA run's role as a Hugging Face folder: merged weights, or a PEFT adapter folder.

    export_lora_role(dist_dir, out_dir, config_dir, settings, mode="adapter")  # adapter_config.json + adapter_model.safetensors
    export_lora_role(dist_dir, out_dir, config_dir, settings, mode="merged")   # config.json + model.safetensors (W + s B A)

The role's torch_dist folder holds the frozen base weights and the adapters (`lora_a`, `lora_b` beside each adapted
linear's weight). Both are loaded into a one-process model with the run's adapters attached; "merged" writes
W + (alpha / r) B A under the base's names, "adapter" writes the adapters under PEFT's names (a fused megatron
linear's one A repeated for each Hugging Face module it stands for), which `peft.PeftModel.from_pretrained` loads
onto the base model.
"""

from __future__ import annotations

import json
import os

from stacx.parallel.groups import ProcessGroups

LORA_EXPORT_MODES = ("merged", "adapter")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def write_peft_adapter(model, groups: ProcessGroups, settings, out_dir: str, base_model: str | None) -> None:
    """Write `model`'s adapters as a PEFT folder (every rank calls: the adapters are gathered; rank 0 writes)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from stacx.models import iter_hf_weight_buckets
    from stacx.models.lora import peft_adapter_config, peft_named_tensors

    named = [pair for bucket in iter_hf_weight_buckets(model, groups, 1 << 30, adapters=True) for pair in bucket]
    if dist.get_rank() != 0:
        return
    if any(".mlp.experts." in name for name, _ in named):
        raise ValueError("a PEFT adapter folder of routed experts' adapters is not supported (transformers fuses the "
                         "experts' weights); export with --lora merged")
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: tensor.clone() for name, tensor in peft_named_tensors(named).items()}  # the repeated A: copies
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_adapter_config(settings, base_model), f, indent=2)


def _export_rank(groups: ProcessGroups, dist_dir: str, out_dir: str, config_dir: str, settings, mode: str, what: str) -> None:
    from stacx.checkpointing.torch_dist import load_torch_dist
    from stacx.models import build_model
    from stacx.models.checkpoint import export_hf_checkpoint
    from stacx.models.lora import attach_lora

    from stacx.checkpointing.value_head import holds_torch_dist_value_head, read_torch_dist_value_head

    model = build_model(config_dir, groups, initialize_weights=False)
    attach_lora(model, settings, groups)
    # A critic trained with --lora-critic adapters: merged, its value head written as *ForTokenClassification's score
    critic = holds_torch_dist_value_head(dist_dir, model.config.hidden_size)
    if critic and mode != "merged":
        raise ValueError(f"{what} {dist_dir}: a critic's adapters export merged only (a PEFT adapter folder would "
                         "lose its value head); use --lora merged")
    load_torch_dist(dist_dir, model, what=what, value_head=critic)
    if mode == "merged":
        value_head = read_torch_dist_value_head(dist_dir, model.config.hidden_size) if critic else None
        export_hf_checkpoint(model, out_dir, groups, config_dir, tokenizer_from=config_dir, value_head=value_head)
    else:
        write_peft_adapter(model, groups, settings, out_dir, base_model=config_dir)


def export_lora_role(dist_dir: str | os.PathLike, out_dir: str | os.PathLike, config_dir: str, settings, *,
                     mode: str, what: str = "--load") -> str:
    """Write a LoRA role's torch_dist folder as merged Hugging Face weights or a PEFT adapter folder."""
    from stacx.checkpointing.convert import _require_empty_output, single_process_world
    from stacx.checkpointing.folders import resolve_torch_dist_folder

    if mode not in LORA_EXPORT_MODES:
        raise ValueError(f"--lora must be one of {list(LORA_EXPORT_MODES)}, got {mode!r}")
    _require_empty_output(out_dir)
    files_dir = resolve_torch_dist_folder(dist_dir, flag=what)
    with single_process_world() as groups:
        _export_rank(groups, os.fspath(files_dir), os.fspath(out_dir), config_dir, settings, mode, what)
    return os.fspath(out_dir)
