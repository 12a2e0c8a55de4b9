"""An exported Hugging Face folder carries the tokenizer of the checkpoint the model started from,
so `stacx eval`, `stacx serve` and transformers can use it on its own."""

from __future__ import annotations

import os

from stacx.models.checkpoint import TOKENIZER_FILES, export_hf_checkpoint
from stacx.rollout.engines.cpu import CpuEngine
from stacx.tasks import write_tiny_checkpoint


def test_export_with_tokenizer_from_is_a_complete_folder(tmp_path):
    from transformers import AutoTokenizer

    source = write_tiny_checkpoint(str(tmp_path / "ckpt"), "sorting", seed=0)
    engine = CpuEngine.from_hf_checkpoint(source)
    bare, complete = str(tmp_path / "bare"), str(tmp_path / "complete")
    export_hf_checkpoint(engine.model, bare, engine.groups)
    export_hf_checkpoint(engine.model, complete, engine.groups, tokenizer_from=source)

    assert not any(os.path.isfile(os.path.join(bare, name)) for name in TOKENIZER_FILES if name != "generation_config.json")
    original, exported = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(complete)
    assert exported("31415=", add_special_tokens=False)["input_ids"] == original("31415=", add_special_tokens=False)["input_ids"]
    assert exported.eos_token_id == original.eos_token_id
