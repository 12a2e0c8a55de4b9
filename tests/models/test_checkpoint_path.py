"""A checkpoint path that is not a local Hugging Face folder fails at once, naming the flag and the path,
and is never handed to `transformers` (which would take it for a Hub id and retry downloads for a minute)."""

from __future__ import annotations

import time

import pytest

from stacx.launch.cli import main as stacx_main
from stacx.models.checkpoint import CheckpointNotFoundError, require_hf_checkpoint_folder
from stacx.tasks import write_tiny_checkpoint
from stacx.rollout.service import load_tokenizer


def test_missing_file_and_non_checkpoint_folders_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=r"--hf-checkpoint outputs/ckpt: folder not found .*outputs/ckpt"):
        require_hf_checkpoint_folder("outputs/ckpt")  # looks like a Hub id "org/name"
    with pytest.raises(CheckpointNotFoundError, match=r"--ref-load outputs/ref: folder not found"):
        require_hf_checkpoint_folder("outputs/ref", flag="--ref-load")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match="is a file, not a folder"):
        require_hf_checkpoint_folder("weights.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="empty: the folder has no config.json"):
        require_hf_checkpoint_folder("empty")
    with pytest.raises(CheckpointNotFoundError, match="--hf-checkpoint is empty"):
        require_hf_checkpoint_folder("")
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)


def test_load_tokenizer_of_a_missing_folder_fails_at_once_without_asking_the_hub(tmp_path, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("transformers was asked to load a path that is not a local folder")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    started = time.monotonic()
    with pytest.raises(CheckpointNotFoundError, match="--hf-checkpoint outputs/ckpt: folder not found"):
        load_tokenizer("outputs/ckpt")
    assert time.monotonic() - started < 10  # vs about 60 s of Hub retries before


def test_load_tokenizer_reads_a_local_checkpoint_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = write_tiny_checkpoint(str(tmp_path / "ckpt"), "sorting", seed=0)
    assert load_tokenizer(folder)("123", add_special_tokens=False)["input_ids"]


def test_stacx_serve_names_a_missing_checkpoint_folder(tmp_path, monkeypatch):
    import stacx.serving.cpu_engine  # noqa: F401  (imported first: the bound below times the check, not imports)
    import stacx.serving.server  # noqa: F401

    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(SystemExit, match="stacx serve: --hf-checkpoint outputs/missing: folder not found"):
        stacx_main(["serve", "--hf-checkpoint", "outputs/missing", "--port", "0"])
    assert time.monotonic() - started < 10
