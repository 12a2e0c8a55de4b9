"""bench/lora_gradient_init.py's start adapters (in-process; no run): every A spans the top input directions of its
linear's update (the fused linears' rows stacked, one A shared as Stacx's fused linears share it), at the random
init's row norm, every B zero, in a PEFT folder of rank 8, alpha 16."""

import json
import math

import torch
from safetensors.torch import load_file, save_file

from bench.lora_gradient_init import write_subspace_adapter

HIDDEN, FFN = 16, 24


def _model(folder, weights):
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    return str(folder)


def test_each_a_spans_the_top_input_directions_of_its_linears_update_and_b_is_zero(tmp_path):
    generator = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
              "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}
    start = {f"model.layers.0.{name}.weight": torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    start["model.embed_tokens.weight"] = torch.randn(5, HIDDEN, generator=generator)
    moved = {name: weight + 0.01 * torch.randn(weight.shape, generator=generator) for name, weight in start.items()}
    folder = write_subspace_adapter(str(tmp_path / "adapter"), _model(tmp_path / "start", start),
                                    _model(tmp_path / "moved", moved))

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16.0, False)
    tensors = load_file(f"{folder}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0."
    for first, siblings in (("self_attn.q_proj", ("self_attn.k_proj", "self_attn.v_proj")),
                            ("mlp.gate_proj", ("mlp.up_proj",)), ("self_attn.o_proj", ()), ("mlp.down_proj", ())):
        a = tensors[f"{prefix}{first}.lora_A.weight"].double()
        for sibling in siblings:
            assert torch.equal(tensors[f"{prefix}{sibling}.lora_A.weight"], tensors[f"{prefix}{first}.lora_A.weight"])
        update = torch.cat([moved[f"model.layers.0.{name}.weight"] - start[f"model.layers.0.{name}.weight"]
                            for name in (first, *siblings)]).double()
        top = torch.linalg.svd(update, full_matrices=False)[2][:8]
        assert torch.allclose(a @ a.T, torch.eye(8, dtype=torch.float64) / 3, atol=1e-6)  # orthogonal, norm sqrt(1/3)
        assert torch.allclose(a @ top.T @ top, a, atol=1e-5)  # inside the update's top-8 input subspace
        for name in (first, *siblings):
            b = tensors[f"{prefix}{name}.lora_B.weight"]
            assert b.shape == (shapes[name][0], 8) and not b.any()
    assert math.isclose(float(a.norm(dim=1)[0]), math.sqrt(1 / 3), rel_tol=1e-5)


def test_a_gradient_init_arm_takes_the_probe_steps_and_run_values():
    import pytest

    from bench.lora_gradient_init import gradient_arm, probe_name

    assert gradient_arm("1e-3") == ("LoRA r=8 a=16 lr=0.001 A from dW1", 1e-3, 1, {})
    assert gradient_arm("7.5e-4:probe=3:lora_plus_ratio=2") == (
        "LoRA r=8 a=16 lr=0.00075 A from dW3 lora_plus_ratio=2", 7.5e-4, 3, {"lora_plus_ratio": 2.0})
    assert (probe_name(1), probe_name(3)) == ("probe", "probe 3 steps")
    with pytest.raises(SystemExit, match="LR\\[:probe=K\\]"):
        gradient_arm("fast")
