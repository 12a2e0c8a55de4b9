"""Copy streamed Hugging Face-named tensors into a megatron model (the receiving end of weight sync).

A megatron parameter may be assembled from several HF tensors (q/k/v -> linear_qkv, gate/up
-> linear_fc1), and a bucket boundary may fall between them, so pieces wait in `pending`
until their parameter is complete. Each rank keeps only its TP shard (`local_slices`).

An update is all-or-nothing per call: every name, shape and dtype of the given tensors is checked
before any parameter is written, so a rejected bucket leaves the model as it was.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from stacx.parallel.groups import ProcessGroups


class HfWeightReceiver:
    """Receives (hf_name, full tensor) pairs in any grouping and writes finished parameters."""

    def __init__(self, model, groups: ProcessGroups):
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import hf_config_of, unwrap_model
        from stacx.models.architectures import decoder_shape
        from stacx.models.weight_mapping import IGNORED_HF_SUFFIXES, param_mappings

        gpt = unwrap_model(model)
        self.groups = groups
        self.shape = decoder_shape(hf_config_of(gpt))
        self.params = dict(gpt.named_parameters())
        self.ignored_suffixes = IGNORED_HF_SUFFIXES
        self.targets = defaultdict(list)  # hf_name -> [(mapping, index in mapping.hf_names)]
        # Imported here, like stacx.models above: megatron-core is slow to import (start-up time).
        from stacx.models.lora import adapter_param_mappings

        # A model with LoRA adapters (an engine taking adapter-only syncs) also receives them, under PEFT's names.
        for mapping in param_mappings(gpt) + adapter_param_mappings(gpt):
            for index, hf_name in enumerate(mapping.hf_names):
                self.targets[hf_name].append((mapping, index))
        self.pending: dict[str, dict[int, torch.Tensor]] = {}

    def update_size(self) -> tuple[int, int]:
        """(tensor bytes, tensors) of the largest weight update this model takes: every parameter
        element at the widest of fp32 and the parameters' dtype (a trainer may push fp32 into a
        bf16 server), the tied output layer counted again (a sender may include it), and every
        Hugging Face tensor name once."""
        num_elements = sum(p.numel() for p in self.params.values())
        if self.shape.tie_word_embeddings:
            num_elements += max(p.numel() for name, p in self.params.items() if "word_embeddings" in name)
        itemsize = max([4] + [p.element_size() for p in self.params.values()])
        return num_elements * itemsize, len(self.targets) + 1

    def _is_ignored(self, hf_name: str) -> bool:
        return hf_name.endswith(self.ignored_suffixes) or (hf_name == "lm_head.weight" and self.shape.tie_word_embeddings)

    def validate(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError (naming the tensor) unless every tensor is a parameter piece of this
        model with the expected shape, a floating-point dtype, and appears once in the call."""
        seen = set()
        for hf_name, tensor in named_tensors:
            if hf_name in seen:
                raise ValueError(f"weight update: tensor {hf_name!r} appears twice in one bucket")
            seen.add(hf_name)
            targets = self.targets.get(hf_name)
            if targets is None:
                if self._is_ignored(hf_name):
                    continue
                raise ValueError(f"weight update: tensor {hf_name!r} is not a parameter of this model")
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"weight update: tensor {hf_name!r} has dtype {tensor.dtype}; parameters need a "
                                 "floating-point dtype")
            for mapping, index in targets:
                expected = mapping.hf_shapes(self.shape, self.groups.tp_size)[index]
                if tuple(tensor.shape) != tuple(expected):
                    raise ValueError(f"weight update: tensor {hf_name!r} has shape {list(tensor.shape)}, expected {list(expected)}")

    @torch.no_grad()
    def receive(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Check the whole call (`validate`), then write every parameter completed by these tensors.
        Pieces still waiting are cloned: the tensors may view a transport buffer that the next
        bucket reuses."""
        named_tensors = list(named_tensors)
        self.validate(named_tensors)
        added = []
        for hf_name, tensor in named_tensors:
            targets = self.targets.get(hf_name)
            if targets is None:
                continue  # ignored (validated above)
            for mapping, index in targets:
                pieces = self.pending.setdefault(mapping.megatron_name, {})
                pieces[index] = tensor
                added.append((mapping.megatron_name, index))
                if len(pieces) == len(mapping.hf_names):
                    del self.pending[mapping.megatron_name]
                    self._write(mapping, [pieces[i] for i in range(len(mapping.hf_names))])
        for name, index in added:
            if name in self.pending and index in self.pending[name]:
                self.pending[name][index] = self.pending[name][index].clone()

    def _write(self, mapping, full_tensors: list[torch.Tensor]) -> None:
        slices = mapping.local_slices(self.shape, self.groups.tp_rank, self.groups.tp_size)
        local = []
        for tensor, part in zip(full_tensors, slices):
            if part.dim is None:
                local.append(tensor)
            else:
                local.append(tensor.narrow(part.dim, part.start, part.stop - part.start))
        param = self.params[mapping.megatron_name]
        if mapping.kind in ("replicated", "row") or (mapping.kind == "vocab" and local[0].shape == param.shape):
            param.copy_(local[0])  # one copy, no intermediate
        else:
            param.copy_(mapping.assemble_local(local, self.shape, self.groups.tp_size))

    def check_complete(self) -> None:
        """Raise if some parameter got only part of its HF tensors (a truncated update)."""
        if self.pending:
            name, pieces = next(iter(self.pending.items()))
            raise ValueError(
                f"weight update incomplete: parameter {name!r} received {len(pieces)} of its Hugging Face tensors"
                + (f" ({len(self.pending) - 1} more parameters incomplete)" if len(self.pending) > 1 else "")
            )
