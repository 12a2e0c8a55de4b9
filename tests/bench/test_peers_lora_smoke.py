"""bench/peers/train_step_vs_trl.py --smoke --lora-rank: TRL's GRPOTrainer with a PEFT LoraConfig and Stacx with
--lora-rank run the same step from the same adapters and agree while they must (module doc of the bench)."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_peers_smoke import leaves_no_world_behind, load_bench  # noqa: F401  (the fixture)


@pytest.mark.slow
def test_lora_smoke_run_compares_trl_peft_and_stacx_lora_steps(tmp_path, leaves_no_world_behind):  # noqa: F811
    output = tmp_path / "peers_lora.json"
    assert load_bench().main(["--smoke", "--sizes", "S", "--skip-memory", "--lora-rank", "4",
                              "--out", str(output)]) == 0
    (row,) = json.loads(output.read_text())["rows"]
    assert row["lora"] == {"rank": 4, "alpha": 16.0, "compared_steps": 2}
    # only adapters train; Stacx's fused q/k/v and gate/up hold one A where PEFT holds one per module
    assert 0 < row["trainable_parameters"]["stacx"] < row["trainable_parameters"]["trl"]
    assert row["max_loss_rel_diff"] <= 1e-4 and row["max_grad_norm_rel_diff"] <= 1e-4
    assert row["trl_steps"][0]["loss"] != row["trl_steps"][1]["loss"]  # the adapters moved
