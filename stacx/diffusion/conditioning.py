"""Conditioners: prompts -> the conditioning a transformer family takes. No download: both are
small learned tables built from the config's vocabulary and trained with the transformer.

- `LabelConditioner` (DiT): each prompt of the vocabulary is one class label.
- `TextConditioner` (MMDiT): a word-level embedding of the prompt, giving per-word states
  [B, L, D] (the joint attention's text stream) and their mean over the words, [B, D] (the
  pooled projection).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import nn

from stacx.diffusion.config import DiffusionConfigError, DiffusionModelConfig

PAD_ID, UNKNOWN_ID = 0, 1
_WORD = re.compile(r"[a-z0-9]+")


def prompt_words(prompt: str) -> list[str]:
    """Lower-case words of a prompt ('A red circle.' -> ['a', 'red', 'circle'])."""
    return _WORD.findall(prompt.lower())


class LabelConditioner(nn.Module):
    """prompt -> class index (its position in `config.vocabulary`)."""

    def __init__(self, config: DiffusionModelConfig):
        super().__init__()
        self.prompts = tuple(config.vocabulary)
        self._index = {prompt: i for i, prompt in enumerate(self.prompts)}

    @property
    def num_classes(self) -> int:
        return len(self.prompts)

    def forward(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        missing = [p for p in prompts if p not in self._index]
        if missing:
            raise ValueError(f"label conditioner: prompt {missing[0]!r} is not one of its {self.num_classes} classes "
                             f"(the config's vocabulary); use a text conditioner (family 'mmdit') for free prompts")
        return {"class_labels": torch.tensor([self._index[p] for p in prompts], dtype=torch.long)}


class TextConditioner(nn.Module):
    """prompt -> (encoder_hidden_states [B, L, D], pooled_projections [B, D]) from learned word embeddings."""

    def __init__(self, config: DiffusionModelConfig):
        super().__init__()
        self.words = tuple(config.vocabulary)
        self._ids = {word: i + 2 for i, word in enumerate(self.words)}
        self.max_words = config.max_prompt_words
        self.word_embedding = nn.Embedding(len(self.words) + 2, config.text_dim, padding_idx=PAD_ID)
        self.position_embedding = nn.Parameter(torch.zeros(config.max_prompt_words, config.text_dim))
        nn.init.normal_(self.word_embedding.weight, std=1.0)
        nn.init.normal_(self.position_embedding, std=0.1)

    def token_ids(self, prompts: Sequence[str]) -> torch.Tensor:
        """[B, L] word ids (PAD_ID after the prompt, UNKNOWN_ID for words outside the vocabulary)."""
        ids = torch.full((len(prompts), self.max_words), PAD_ID, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt_words(prompt)[: self.max_words] or ["<empty>"]
            ids[row, : len(words)] = torch.tensor([self._ids.get(w, UNKNOWN_ID) for w in words])
        return ids

    def forward(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        ids_BL = self.token_ids(prompts).to(self.word_embedding.weight.device)
        present_BL1 = (ids_BL != PAD_ID).unsqueeze(-1).to(self.word_embedding.weight.dtype)
        states_BLD = (self.word_embedding(ids_BL) + self.position_embedding) * present_BL1
        pooled_BD = states_BLD.sum(dim=1) / present_BL1.sum(dim=1).clamp_min(1.0)
        return {"encoder_hidden_states": states_BLD, "pooled_projections": pooled_BD}


CONDITIONER_CLASSES = {"label": LabelConditioner, "text": TextConditioner}


def build_conditioner(config: DiffusionModelConfig) -> nn.Module:
    """The conditioner named by `config.conditioner`."""
    try:
        return CONDITIONER_CLASSES[config.conditioner](config)
    except KeyError:
        raise DiffusionConfigError(f"unknown conditioner {config.conditioner!r}; known: "
                                   f"{', '.join(CONDITIONER_CLASSES)}") from None
