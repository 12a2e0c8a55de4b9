"""Built-in tasks: answers are right, data files are deterministic and loadable, checkpoints load."""

from __future__ import annotations

import json
import random

import pytest

from stacx.tasks import TASKS, get_task, resolve_data_path, task_rows, write_tiny_checkpoint


def test_task_answers_are_correct_by_independent_computation():
    rng = random.Random(7)
    for _ in range(200):
        prompt, answer = get_task("sorting").sample(rng)
        assert prompt.endswith("=") and answer == "".join(sorted(prompt[:-1]))
        prompt, answer = get_task("addition").sample(rng)
        a, b = prompt[:-1].split("+")
        assert int(answer) == int(a) + int(b) and 0 <= int(b) <= 9
        prompt, answer = get_task("reversal").sample(rng)
        assert answer == prompt[:-1][::-1]
    for task in TASKS.values():
        for prompt, answer in [task.sample(rng) for _ in range(50)]:
            assert set(prompt + answer) <= set(task.alphabet) and len(answer) <= task.max_answer_chars
    assert get_task("sorting").reward(" 0123 ", "0123") == 1.0 and get_task("sorting").reward("0124", "0123") == 0.0
    with pytest.raises(ValueError, match="unknown built-in task 'nope'; known tasks: addition"):
        get_task("nope")


@pytest.mark.slow
def test_builtin_data_is_deterministic_disjoint_and_serves_every_kind(tmp_path):
    from transformers import AutoTokenizer

    from stacx.rollout.data import DataConfig, load_examples

    train = resolve_data_path("builtin:sorting", out_dir=str(tmp_path / "a"))
    again = resolve_data_path("builtin:sorting", out_dir=str(tmp_path / "b"))
    assert open(train).read() == open(again).read()
    held_out = resolve_data_path("builtin:sorting/eval", out_dir=str(tmp_path / "a"))
    train_prompts = {json.loads(line)["prompt"] for line in open(train)}
    eval_rows = [json.loads(line) for line in open(held_out)]
    assert len(train_prompts) > 1000 and eval_rows and not train_prompts & {row["prompt"] for row in eval_rows}
    for row in task_rows(get_task("sorting"), "train")[:100]:
        assert row["rejected"] != row["chosen"] == row["label"] == row["response"]
        assert sum(x != y for x, y in zip(row["rejected"], row["chosen"])) == 1
    assert resolve_data_path("data/x.jsonl", out_dir="unused") == "data/x.jsonl"
    with pytest.raises(ValueError, match="prompt data 'builtin:sorting/test': split 'test'"):
        resolve_data_path("builtin:sorting/test", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="prompt data 'builtin:nope'"):
        resolve_data_path("builtin:nope", out_dir=str(tmp_path))

    folder = write_tiny_checkpoint(str(tmp_path / "ckpt"), "sorting", hidden_size=32, num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    first = json.loads(open(train).readline())
    sft = load_examples(DataConfig(path=train, kind="sft", apply_chat_template=False), tokenizer)[0]
    assert tokenizer.decode(sft.prompt_ids) == first["prompt"]
    assert sft.response_ids == tokenizer(first["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    dpo = load_examples(DataConfig(path=train, kind="dpo", apply_chat_template=False), tokenizer)[0]
    assert tokenizer.decode(dpo.rejected_ids, skip_special_tokens=True) == first["rejected"]
    prompt = load_examples(DataConfig(path=train, kind="prompt", apply_chat_template=False), tokenizer)[0]
    assert prompt.label == first["label"]


def test_tiny_checkpoint_matches_transformers_in_stacx_engine(tmp_path):
    """The checkpoint loads into Stacx's megatron model and gives transformers' log-probs (fp32, 1e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stacx.rollout.engines.cpu import CpuEngine
    from stacx.rollout.types import GenerateRequest, SamplingParams

    folder = write_tiny_checkpoint(str(tmp_path / "ckpt"), "sorting", seed=3)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert reference.config.vocab_size == 17 and reference.config.eos_token_id == 1
    engine = CpuEngine.from_hf_checkpoint(folder)
    prompt = [12, 12, 6, 10, 14, 16]
    out = engine.generate([GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, temperature=1.0,
                                                                                      ignore_eos=True),
                                           return_logprob=True)])[0]
    sequence = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(reference(sequence).logits[0].double(), -1)
    expected = [log_probs[len(prompt) - 1 + j, token].item() for j, token in enumerate(out.output_ids)]
    assert out.output_log_probs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("kind", ["tool", "moe"])
def test_tiny_tool_and_moe_checkpoints_load_and_generate_in_stacx_engine(tmp_path, kind):
    """A new user's first agent or MoE run starts from one call, not from model code: the tool checkpoint's
    tokenizer renders tool calls with its chat template; the MoE one is a Qwen3-MoE the engine routes."""
    from transformers import AutoConfig, AutoTokenizer

    from stacx.rollout.engines.cpu import CpuEngine
    from stacx.rollout.types import GenerateRequest, SamplingParams
    from stacx.tasks import write_tiny_moe_checkpoint, write_tiny_tool_checkpoint

    if kind == "tool":
        folder = write_tiny_tool_checkpoint(str(tmp_path / "ckpt"), style="qwen")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1+2"}], tools=tools, tokenize=False,
                                             add_generation_prompt=True)
        assert '"name": "add"' in text and text.rstrip().endswith("assistant")
    else:
        folder = write_tiny_moe_checkpoint(str(tmp_path / "ckpt"), num_experts=4)
        config = AutoConfig.from_pretrained(folder)
        assert config.model_type == "qwen3_moe" and config.num_experts == 4
        tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = CpuEngine.from_hf_checkpoint(folder)
    prompt = tokenizer("12", add_special_tokens=False)["input_ids"]
    out = engine.generate([GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=4, temperature=1.0,
                                                                                      ignore_eos=True),
                                           return_logprob=True)])[0]
    assert len(out.output_ids) == 4 and all(lp <= 0 for lp in out.output_log_probs)
