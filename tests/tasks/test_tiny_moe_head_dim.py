"""The tiny Qwen3-MoE in a shape vLLM's CPU attention serves (head size 32: it takes sizes from 32 up), beside the
default shape (head size 16) other tests depend on: same hidden size, half the heads, and Stacx's engine (the
trainer's model builder) generates from it. vLLM generating from it and taking pushed weights:
bench/vllm_moe_bf16.py (docs/vllm.md)."""

from __future__ import annotations

import json

import pytest

from stacx.tasks import write_tiny_moe_checkpoint


def test_the_tiny_moe_takes_a_head_size_vllm_serves_and_keeps_its_default(tmp_path):
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.wire.types import GenerateRequest, SamplingParams

    folder = write_tiny_moe_checkpoint(str(tmp_path / "wide"), num_experts=4, head_dim=32)
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert (config["head_dim"], config["num_attention_heads"], config["hidden_size"]) == (32, 2, 64)
    engine = CpuEngine.from_hf_checkpoint(folder)
    (out,) = engine.generate([GenerateRequest(input_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=3,
                                                                                           ignore_eos=True))])
    assert len(out.output_ids) == 3
    write_tiny_moe_checkpoint(str(tmp_path / "default"), num_experts=4)
    config = json.loads((tmp_path / "default" / "config.json").read_text())
    assert (config["head_dim"], config["num_attention_heads"]) == (16, 4)
    with pytest.raises(ValueError, match="head_dim 24 must be a positive divisor of hidden_size 64"):
        write_tiny_moe_checkpoint(str(tmp_path / "bad"), head_dim=24)
