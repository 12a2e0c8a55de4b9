"""An exported Hugging Face folder carries the tokenizer of the checkpoint the model started from,
so `stacx eval`, `stacx serve` and transformers can use it on its own."""

from __future__ import annotations

import os

from stacx.models.checkpoint import TOKENIZER_FILES, export_hf_checkpoint
from stacx.serving.cpu_engine import CpuEngine
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


def test_every_exported_file_takes_its_mode_from_the_umask(tmp_path):
    """model.safetensors was 0600 (safetensors renames a private temporary into place), and copies kept
    the source's mode; every file is now 0666 less the umask, like config.json."""
    from stacx.checkpointing.convert import single_process_world
    from stacx.models import build_model
    from stacx.models.checkpoint import load_hf_checkpoint
    from stacx.models.testing import save_tiny_hf_checkpoint

    source = str(tmp_path / "source")
    save_tiny_hf_checkpoint(source, "llama", seed=0)
    (tmp_path / "source" / "tokenizer_config.json").write_text("{}")
    os.chmod(tmp_path / "source" / "tokenizer_config.json", 0o600)
    out = str(tmp_path / "out")
    previous = os.umask(0o027)
    try:
        with single_process_world() as groups:
            model = build_model(source, groups, initialize_weights=False)
            load_hf_checkpoint(model, source, groups)
            export_hf_checkpoint(model, out, groups, source, tokenizer_from=source)
    finally:
        os.umask(previous)
    modes = {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777) for name in os.listdir(out)}
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= set(modes)
    assert modes == {name: "0o640" for name in modes}
