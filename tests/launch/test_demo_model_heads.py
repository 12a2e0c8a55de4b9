"""The demo's model size names its attention heads: a demo-sized model vLLM can serve (vLLM's CPU attention takes
head sizes from 32 up) is the demo's model with two heads of 32 (bench/vllm_demo_task.py)."""

from __future__ import annotations

import os


def test_the_demo_writes_its_models_with_the_heads_its_settings_name(tmp_path, monkeypatch):
    import stacx.tasks
    from stacx.launch.demo.phases import TinyModel
    from stacx.launch.demo.pipeline import DemoSettings, _prepare

    written = {}

    def write_tiny_checkpoint(out_dir, task_name, **size):
        written[os.path.basename(out_dir)] = (size["hidden_size"], size["num_attention_heads"])
        return out_dir

    monkeypatch.setattr(stacx.tasks, "write_tiny_checkpoint", write_tiny_checkpoint)
    monkeypatch.setattr(stacx.tasks, "resolve_data_path", lambda spec, out_dir: spec)
    _prepare(DemoSettings(teacher=TinyModel(hidden_size=64, num_layers=2, num_attention_heads=2)), str(tmp_path))
    assert written == {"init": (64, 2), "student_init": (32, 4)}  # the student keeps the default four heads
