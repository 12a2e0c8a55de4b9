"""docs/data.md: every example row parses as the kind it documents, the chat-template option and the
built-in tasks are described as they are, and the doc is linked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stacx.rollout.data import KINDS, DataConfig, MalformedRowError, load_examples
from stacx.tasks import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "data.md"


def _examples_by_kind() -> dict[str, str]:
    blocks = re.findall(r"^```jsonl (\w+)\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
    return {kind: body for kind, body in blocks}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "c"), "sorting"))


def test_every_kind_has_an_example_that_parses(tmp_path, tokenizer):
    examples = _examples_by_kind()
    assert sorted(examples) == sorted(KINDS)
    for kind, body in examples.items():
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(body)
        rows = load_examples(DataConfig(path=str(path), kind=kind, apply_chat_template=True), tokenizer)
        assert len(rows) == len(body.strip().splitlines()), kind
        if kind == "prompt":
            assert [row.label for row in rows] == ["42", "Paris"] and rows[1].metadata["source"] == "geo"
        elif kind == "sft":
            assert all(row.response_ids and row.response_ids[-1] == tokenizer.eos_token_id for row in rows)
        else:
            assert rows[0].chosen_ids and rows[0].rejected_ids


def test_the_documented_rules_are_the_enforced_ones(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # last message must be the assistant's
    with pytest.raises(MalformedRowError, match=r"bad.jsonl:1: 'messages' must end with an assistant message"):
        load_examples(DataConfig(path=str(path), kind="sft", apply_chat_template=True), tokenizer)
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": ""}\n')
    with pytest.raises(MalformedRowError, match="'rejected' must be a non-empty string"):
        load_examples(DataConfig(path=str(path), kind="dpo"), tokenizer)


def test_readme_and_architecture_link_the_data_formats_doc():
    assert "data.md" in (REPO / "README.md").read_text()
    assert "data.md" in (REPO / "docs" / "architecture.md").read_text()


def test_every_builtin_task_is_in_the_table_with_its_alphabet_and_split_sizes():
    from stacx.tasks.builtin import TASKS
    from stacx.tasks.data import DEFAULT_NUM_EVAL, DEFAULT_NUM_TRAIN

    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| .*? \| `([^`]+)` \|$", text, flags=re.M))
    assert rows == {name: task.alphabet for name, task in TASKS.items()}
    assert f"training split ({DEFAULT_NUM_TRAIN} rows)" in text and f"held-out split\n  ({DEFAULT_NUM_EVAL} rows" in text


def test_the_chat_template_section_names_real_flags(tokenizer):
    from stacx.launch.cli import build_parser

    text = DOC.read_text()
    assert "## Chat templates" in text
    for command in ("train", "eval"):
        help_text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        assert "--apply-chat-template" in help_text, command
