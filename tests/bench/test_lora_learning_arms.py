"""bench/lora_learning.py's --arm specs (in-process; no run): the four fields, then run-config FIELD=VALUE values."""

import pytest

from bench.lora_learning import lora_arm


def test_an_arm_takes_rank_alpha_lr_warmup_and_run_values():
    name, values = lora_arm("8:16:3.125e-4:0:lora_plus_ratio=16:lora_rslora=true:lora_init=principal")
    assert values == {"lora_rank": 8, "lora_alpha": 16.0, "lr": 3.125e-4, "lr_warmup_steps": 0,
                      "lora_plus_ratio": 16.0, "lora_rslora": True, "lora_init": "principal"}
    assert name == "LoRA r=8 a=16 lr=3.125e-4 wu=0 lora_plus_ratio=16 lora_rslora=true lora_init=principal"
    assert lora_arm("8:16:5e-3:0") == ("LoRA r=8 a=16 lr=5e-3 wu=0", {"lora_rank": 8, "lora_alpha": 16.0, "lr": 5e-3,
                                                                        "lr_warmup_steps": 0})


@pytest.mark.parametrize("spec", ["8:16:5e-3", "8:16:5e-3:0:lora_plus_ratio", "x:16:5e-3:0"])
def test_a_malformed_arm_is_refused_naming_the_format(spec):
    with pytest.raises(SystemExit, match="RANK:ALPHA:LR:WARMUP"):
        lora_arm(spec)
