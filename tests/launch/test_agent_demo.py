"""The agent demo's data and initial model (in-process; the full `stacx demo --agent` run is measured
in docs/performance.md, "The agent demo", not run here: two training runs cost the suite ~26 s)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from stacx.launch.demo.agent import AgentDemoSettings, _prepare
from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer


def test_prepare_writes_compact_transcripts_disjoint_pairs_and_a_wide_initialization(tmp_path):
    settings = AgentDemoSettings(num_train_pairs=8, num_eval_pairs=4)
    tokenizer = build_tool_chat_tokenizer(settings.chat_style)
    paths = _prepare(settings, str(tmp_path), tokenizer)
    rows = {name: [json.loads(line) for line in open(paths[name])] for name in ("train", "eval", "sft")}
    assert [len(rows[name]) for name in ("train", "eval", "sft")] == [8, 4, 16]  # two SFT turns per training pair
    pairs = {name: {(r["metadata"]["a"], r["metadata"]["b"]) for r in rows[name]} for name in ("train", "eval")}
    assert len(pairs["train"]) == 8 and not pairs["train"] & pairs["eval"]
    assert all(row["prompt"].startswith("<|im_start|>system\ntools: add(a,b)<|im_end|>") for row in rows["sft"])
    with open(os.path.join(paths["init"], "config.json")) as handle:
        assert json.load(handle)["initializer_range"] == settings.init_std == 0.1
    # The saved weights really have that spread (the default 0.02 would leave copying unlearned).
    weights = load_file(os.path.join(paths["init"], "model.safetensors"))
    query = weights["model.layers.0.self_attn.q_proj.weight"]
    assert torch.isclose(query.std(), torch.tensor(0.1), rtol=0.1)
