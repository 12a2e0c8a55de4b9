"""`stacx demo --agent` end to end at a reduced size (slow): both phases run as real training runs
on the shared Ray cluster, and the held-out scores, the table, summary.json and the plot are written.
Whether it learns at full size is measured and recorded in docs/performance.md, not asserted here."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_agent_demo_runs_both_phases_and_reports_heldout_scores(tmp_path, ray_address):
    from stacx.launch.demo.agent import AgentDemoSettings, format_agent_table, run_agent_demo

    settings = AgentDemoSettings(num_train_pairs=16, num_eval_pairs=4, sft_steps=2, sft_batch_size=4, grpo_steps=1,
                                 grpo_prompts_per_step=2, grpo_samples_per_prompt=2, max_new_tokens=8,
                                 progress_bar=False)
    out = str(tmp_path / "demo_agent")
    summary = run_agent_demo(settings, out, log=lambda _: None)
    with open(os.path.join(out, "summary.json")) as handle:
        assert json.load(handle) == json.loads(json.dumps(summary))
    assert [phase["phase"] for phase in summary["phases"]] == ["sft", "grpo"]
    assert list(summary["heldout"]) == ["initial", "after_sft", "after_grpo"]
    for scores in summary["heldout"].values():
        assert 0.0 <= scores["success"] <= scores["tool_call_rate"] <= 1.0  # success needs a tool call
        assert 1.0 <= scores["turns"] <= 3.0 and scores["parse_errors"] >= 0.0
    sft, grpo = summary["phases"]
    assert sft["before"] == summary["heldout"]["initial"]["success"]
    assert grpo["before"] == sft["after"] == summary["heldout"]["after_sft"]["success"]
    with open(os.path.join(out, "sft", "metrics.jsonl")) as handle:
        assert [json.loads(line)["step"] for line in handle] == [0, 1]
    with open(os.path.join(out, "grpo", "metrics.jsonl")) as handle:
        (grpo_row,) = [json.loads(line) for line in handle]
    assert grpo_row["agent/episodes"] == 4.0  # the GRPO rollouts were environment episodes
    # Held-out pairs are new: none of them is a training row.
    rows = {name: [json.loads(line)["metadata"] for line in open(os.path.join(out, "data", f"{name}_episodes.jsonl"))]
            for name in ("train", "heldout")}
    assert not {(r["a"], r["b"]) for r in rows["train"]} & {(r["a"], r["b"]) for r in rows["heldout"]}
    table = format_agent_table(summary)
    assert "held-out success" in table and "after grpo" in table
    assert os.path.getsize(summary["outputs"]["overview_plot"]) > 10_000
