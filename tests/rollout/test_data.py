"""Datasets: formats, chat template, malformed rows, per-epoch shuffling and resumable position."""

import json

import pytest

from stacx.rollout.data import DataConfig, EpochLoader, MalformedRowError, load_examples, load_trajectory_corpus
from stacx.rollout.tokenizer import apply_chat_template, build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_prompt_rows_with_chat_template_and_keys(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"q": "1+1", "a": "2", "m": {"level": 1}},
                                              {"q": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}], "a": "4"}])
    examples = load_examples(DataConfig(path=path, input_key="q", label_key="a", metadata_key="m"), tokenizer)
    assert examples[0].prompt_ids == apply_chat_template(tokenizer, [{"role": "user", "content": "1+1"}])
    assert tokenizer.decode(examples[1].prompt_ids) == "<|system|>be brief<eos><|user|>2+2<eos><|assistant|>"
    assert (examples[0].label, examples[0].metadata, examples[0].source) == ("2", {"level": 1}, f"{path}:1")


def test_parquet_sft_and_dpo(tmp_path, tokenizer):
    import datasets

    parquet = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list([{"prompt": "1+1", "chosen": "2", "rejected": "3"}]).to_parquet(parquet)
    (pair,) = load_examples(DataConfig(path=parquet, kind="dpo"), tokenizer)
    assert tokenizer.decode(pair.chosen_ids) == "2<eos>" and tokenizer.decode(pair.rejected_ids) == "3<eos>"
    sft = _write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi", "response": "ok"},
                                             {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])
    first, second = load_examples(DataConfig(path=sft, kind="sft"), tokenizer)
    assert tokenizer.decode(first.response_ids) == "ok<eos>" and tokenizer.decode(second.response_ids) == "b<eos>"


def test_malformed_rows_fail_with_file_and_line_or_are_skipped(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1"}, "{not json", {"other": 1}, {"prompt": "2"}])
    with pytest.raises(MalformedRowError, match=r"bad.jsonl:2: not valid JSON"):
        load_examples(DataConfig(path=path), tokenizer)
    examples = load_examples(DataConfig(path=path, malformed_rows="skip"), tokenizer)
    assert [e.source.rsplit(":", 1)[1] for e in examples] == ["1", "4"]
    path = _write_jsonl(tmp_path / "bad2.jsonl", [{"prompt": "1"}, {"other": 1}])
    with pytest.raises(MalformedRowError, match=r"bad2.jsonl:2: missing key 'prompt'"):
        load_examples(DataConfig(path=path), tokenizer)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples(DataConfig(path=str(tmp_path / "nope.jsonl")), tokenizer)


def test_epoch_shuffle_is_deterministic_and_position_resumes(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(7)])
    examples = load_examples(DataConfig(path=path), tokenizer)
    loader = EpochLoader(examples, seed=3)
    seen = [e.source for e in loader.next_batch(10)]
    assert sorted(seen[:7]) == sorted(e.source for e in examples) and seen[:7] != [e.source for e in examples]
    state = loader.state_dict()
    upcoming = [e.source for e in loader.next_batch(9)]
    resumed = EpochLoader(examples, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [e.source for e in resumed.next_batch(9)] == upcoming
    assert [e.source for e in EpochLoader(examples, seed=3).next_batch(10)] == seen
    with pytest.raises(ValueError, match="seed"):
        EpochLoader(examples, seed=4).load_state_dict(state)


def test_trajectory_corpus(tmp_path):
    good = _write_jsonl(tmp_path / "c.jsonl", [{"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 1]}])
    assert load_trajectory_corpus(good)[0]["response_ids"] == [2, 3]
    bad = _write_jsonl(tmp_path / "c2.jsonl", [{"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1]}])
    with pytest.raises(MalformedRowError, match="c2.jsonl:1: loss_mask has 1 entries"):
        load_trajectory_corpus(bad)
