"""LoRA exports (stacx.checkpointing.lora_export) and PEFT start adapters, on one spawned rank.

A tiny Qwen3 with adapters on every linear (B != 0) is saved as torch_dist (base and adapters in one folder),
then written as a PEFT adapter folder and as merged Hugging Face weights. `peft.PeftModel.from_pretrained` on
the `transformers` base model, and `transformers` on the merged folder, give Stacx's log-probs to 1e-5; the PEFT
folder loaded back into a fresh Stacx model with adapters (`--load` of a PEFT adapter) gives them too. The same
adapters under rank-stabilized scaling (--lora-rslora, alpha / sqrt(r)) export with `use_rslora: true`, and PEFT,
the merged folder and the reload give that model's log-probs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from stacx.testing.distributed import run_distributed

LENGTHS = [7, 5]
TOLERANCE = 1e-5


def _stacx_log_probs(model, tokens, groups):
    from stacx.models import forward_packed

    with torch.no_grad():
        logits = forward_packed(model, tokens, LENGTHS, groups)
    return logits[:, :101].log_softmax(-1)


def export_and_reload(groups, base: str, root: str):
    from stacx.checkpointing.lora_export import export_lora_role
    from stacx.checkpointing.torch_dist import save_torch_dist
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import LoraSettings, attach_lora, load_peft_adapter
    from tests.models.test_lora import _set_adapters

    settings = LoraSettings(rank=4, alpha=8.0, seed=3)
    tokens = torch.arange(3, 3 + sum(LENGTHS)) % 100
    model = build_model(base, groups, initialize_weights=False)
    load_hf_checkpoint(model, base, groups)
    attach_lora(model, settings, groups)
    _set_adapters(model, groups)
    ours = _stacx_log_probs(model, tokens, groups)
    save_torch_dist(os.path.join(root, "dist"), model, groups=groups)
    export_lora_role(os.path.join(root, "dist"), os.path.join(root, "adapter"), base, settings, mode="adapter")
    export_lora_role(os.path.join(root, "dist"), os.path.join(root, "merged"), base, settings, mode="merged")
    fresh = build_model(base, groups, initialize_weights=False)
    load_hf_checkpoint(fresh, base, groups)
    attach_lora(fresh, settings, groups)
    load_peft_adapter(fresh, os.path.join(root, "adapter"), groups, settings)
    with pytest.raises(ValueError, match="--lora-rank 4 --lora-alpha 8.0"):
        load_peft_adapter(fresh, os.path.join(root, "adapter"), groups, LoraSettings(rank=2, alpha=8.0))
    reloaded = _stacx_log_probs(fresh, tokens, groups)

    # rsLoRA: the same adapter tensors (the torch_dist folder above), scaled by alpha / sqrt(r).
    rs_settings = LoraSettings(rank=4, alpha=8.0, seed=3, rslora=True)
    rs_model = build_model(base, groups, initialize_weights=False)
    load_hf_checkpoint(rs_model, base, groups)
    attach_lora(rs_model, rs_settings, groups)
    _set_adapters(rs_model, groups)
    rs_ours = _stacx_log_probs(rs_model, tokens, groups)
    export_lora_role(os.path.join(root, "dist"), os.path.join(root, "rs_adapter"), base, rs_settings, mode="adapter")
    export_lora_role(os.path.join(root, "dist"), os.path.join(root, "rs_merged"), base, rs_settings, mode="merged")
    rs_fresh = build_model(base, groups, initialize_weights=False)
    load_hf_checkpoint(rs_fresh, base, groups)
    attach_lora(rs_fresh, rs_settings, groups)
    load_peft_adapter(rs_fresh, os.path.join(root, "rs_adapter"), groups, rs_settings)
    with pytest.raises(ValueError, match="use_rslora True.*set --lora-rslora"):
        load_peft_adapter(rs_fresh, os.path.join(root, "rs_adapter"), groups, settings)
    with pytest.raises(ValueError, match="use_rslora False.*drop --lora-rslora"):
        load_peft_adapter(rs_fresh, os.path.join(root, "adapter"), groups, rs_settings)
    return ours, reloaded, tokens, rs_ours, _stacx_log_probs(rs_fresh, tokens, groups)


@pytest.mark.slow  # with tests/models/test_lora.py: 69 s of CPU
@pytest.mark.distributed
def test_peft_round_trip_and_merged_export_give_stacx_log_probs(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from stacx.models.testing import save_tiny_hf_checkpoint

    base = str(tmp_path / "base")
    save_tiny_hf_checkpoint(base, "qwen3", seed=0)
    ours, reloaded, tokens, rs_ours, rs_reloaded = run_distributed(export_and_reload, 1, args=(base, str(tmp_path)),
                                                                   timeout_s=600)[0]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    def hf_log_probs(model):
        with torch.no_grad():
            return torch.cat([model(seq[None]).logits[0] for seq in tokens.split(LENGTHS)]).log_softmax(-1)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           str(tmp_path / "adapter")).eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    assert (hf_log_probs(plain) - ours).abs().max() > 1e-2  # the adapters matter
    assert torch.allclose(hf_log_probs(peft_model), ours, atol=TOLERANCE, rtol=0)
    assert torch.allclose(hf_log_probs(merged), ours, atol=TOLERANCE, rtol=0)
    assert torch.allclose(reloaded, ours, atol=TOLERANCE, rtol=0)

    rs_config = json.loads((tmp_path / "rs_adapter" / "adapter_config.json").read_text())
    assert (rs_config["r"], rs_config["lora_alpha"], rs_config["use_rslora"], config["use_rslora"]) == (4, 8.0, True, False)
    rs_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                        str(tmp_path / "rs_adapter")).eval()
    rs_merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "rs_merged"), dtype=torch.float32).eval()
    assert (rs_ours - ours).abs().max() > 1e-2  # alpha / sqrt(r) = 4 against alpha / r = 2: the scale matters
    assert torch.allclose(hf_log_probs(rs_peft), rs_ours, atol=TOLERANCE, rtol=0)
    assert torch.allclose(hf_log_probs(rs_merged), rs_ours, atol=TOLERANCE, rtol=0)
    assert torch.allclose(rs_reloaded, rs_ours, atol=TOLERANCE, rtol=0)
