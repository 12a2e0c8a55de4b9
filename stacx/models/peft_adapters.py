"""LoRA adapters in PEFT's format: what an adapter-only weight push hands an engine that loads
PEFT adapter folders (vLLM's `/v1/load_lora_adapter`, SGLang's `/load_lora_adapter`).

The trainer streams a push's adapters under PEFT's tensor names without the `base_model.model.` prefix
(`model.layers.0.self_attn.q_proj.lora_A.weight`); a fused megatron linear sends its one A once, under the
first Hugging Face module's name (`SHARED_A`). `peft_named_tensors` gives the folder's tensors (prefix added,
the shared A repeated for each module it stands for) and `write_peft_folder` the folder itself
(`adapter_config.json` + `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` and the engines
load as they would any PEFT adapter.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping

import torch

PEFT_PREFIX = "base_model.model."
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

SHARED_A = {"q_proj": ("k_proj", "v_proj"), "gate_proj": ("up_proj",)}
"""A fused megatron linear has one A for the Hugging Face modules it stands for (q, k and v; gate and up): it is
streamed once, under the first module's name, and `peft_named_tensors` repeats it for the others."""


HF_TARGET_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
                     "experts": ("gate_proj", "up_proj", "down_proj")}
"""PEFT's `target_modules` (Hugging Face module names) of each --lora-target-modules name."""


def hf_target_modules(targets: Iterable[str]) -> list[str]:
    """The sorted Hugging Face module names of --lora-target-modules names (`all-linear`: every one)."""
    names = HF_TARGET_MODULES if "all-linear" in targets else targets
    return sorted({hf for target in names for hf in HF_TARGET_MODULES[target]})


def is_adapter_tensor_name(name: str) -> bool:
    """Whether `name` is a LoRA adapter tensor's PEFT name (`...q_proj.lora_A.weight`)."""
    return name.endswith(ADAPTER_SUFFIXES)


def peft_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{PEFT name: tensor} from the streamed adapters: the shared A of a fused linear repeated for each Hugging
    Face module it stands for, names under `base_model.model.`."""
    out = {}
    for name, tensor in named:
        out[PEFT_PREFIX + name] = tensor
        module = name.removesuffix(".lora_A.weight").rsplit(".", 1)
        if name.endswith(".lora_A.weight") and module[-1] in SHARED_A:
            for sibling in SHARED_A[module[-1]]:
                out[f"{PEFT_PREFIX}{module[0]}.{sibling}.lora_A.weight"] = tensor
    return out


def write_peft_folder(folder: str, tensors: Mapping[str, torch.Tensor], config: Mapping) -> str:
    """Write a PEFT adapter folder: `tensors` (PEFT names, `peft_named_tensors`) and `config`
    (adapter_config.json, `stacx.models.lora.peft_adapter_config`); returns `folder`."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    # safetensors refuses tensors that share memory: the repeated A is copied
    save_file({name: t.detach().contiguous().clone() for name, t in tensors.items()},
              os.path.join(folder, PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, PEFT_CONFIG_FILE), "w", encoding="utf-8") as handle:
        json.dump(dict(config), handle, indent=2)
    return folder
