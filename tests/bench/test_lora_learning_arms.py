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


def test_full_runs_are_reused_from_several_files_the_first_with_a_seed_winning(tmp_path):
    import json

    from bench.lora_learning import reusable_full_runs

    def write(name, accuracy, runs):
        (tmp_path / name).write_text(json.dumps({"sft_accuracy": accuracy, "runs": runs}))
        return str(tmp_path / name)

    first = write("a.json", 0.5, [{"mode": "full", "seed": 0, "accuracy": 0.7, "gain": 0.2},
                                  {"mode": "LoRA", "seed": 1, "accuracy": 0.6}])
    second = write("b.json", 0.5, [{"mode": "full", "seed": 0, "accuracy": 0.1}, {"mode": "full", "seed": 1,
                                                                                   "accuracy": 0.8}])
    reused = reusable_full_runs([first, second], [0, 1])
    assert reused["sft_accuracy"] == 0.5
    assert [(r["seed"], r["accuracy"], r["reused_from"]) for r in reused["runs"]] == [(0, 0.7, "a.json"),
                                                                                     (1, 0.8, "b.json")]
    assert reusable_full_runs([first], [0, 1]) is None  # seed 1 has no full run there
    assert reusable_full_runs([first, write("c.json", 0.4, [{"mode": "full", "seed": 1, "accuracy": 0.8}])],
                              [0, 1]) is None  # another SFT model
