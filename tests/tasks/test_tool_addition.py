"""The agent demo's task: its transcripts are the episode runner's own tokens, and its reward needs
the exact sum after a correct `add` call."""

from __future__ import annotations

import random

import pytest

from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
from stacx.rollout.agents.episode import AgentSession
from stacx.tasks import tool_addition
from stacx.wire.tool_calls import tool_call_style_for


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_chat_tokenizer("qwen")


def play(tokenizer, a: int, b: int, replies: list[str]) -> tuple[list[float], AgentSession]:
    """The rewards of the turns `replies` earn in one episode of (a, b)."""
    session = AgentSession(tool_addition.ToolAdditionEnvironment(), {"a": a, "b": b}, tokenizer=tokenizer,
                           rng=random.Random(0))
    rewards = []
    for text in replies:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        reply = session.respond(ids)
        rewards.append(reply.reward)
        if reply.done:
            break
    return rewards, session


def test_transcripts_are_the_episode_runners_tokens_and_earn_reward_one(tokenizer):
    (call_row, answer_row) = tool_addition.transcript_rows([(12, 34)], tokenizer)
    assert call_row["response"] == '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>'
    assert answer_row["response"] == "46"
    assert call_row["prompt"].endswith("what is 12+34? use add<|im_end|><|im_start|>assistant\n")
    assert answer_row["prompt"].startswith(call_row["prompt"] + call_row["response"] + "<|im_end|>")
    assert "<tool_response>\n46\n</tool_response>" in answer_row["prompt"]  # the tool really ran
    rewards, session = play(tokenizer, 12, 34, [call_row["response"], answer_row["response"]])
    assert rewards == [0.0, 1.0] and session.counts.tool_calls == 1 and session.counts.parse_errors == 0


@pytest.mark.parametrize("replies", [
    ["46"],                                                                           # right sum, no tool call
    ['<tool_call>{"name":"add","arguments":{"a":12,"b":35}}</tool_call>', "47"],      # the tool on other numbers
    ['<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>', "47"],      # a wrong answer
    ['<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>', "46 46"],   # not the number alone
])
def test_no_reward_without_a_correct_call_and_the_exact_sum(tokenizer, replies):
    rewards, _ = play(tokenizer, 12, 34, replies)
    assert rewards[-1] == 0.0


def test_heldout_pairs_are_excluded_and_rows_name_the_environment():
    heldout = tool_addition.addition_pairs(seed=1, count=50)
    train = tool_addition.addition_pairs(seed=0, count=500, exclude=heldout)
    assert len(set(train)) == 500 and not set(train) & set(heldout)
    assert all(10 <= n <= 99 for pair in train for n in pair)
    (row,) = tool_addition.episode_rows([(12, 34)])
    assert row["metadata"] == {"environment": "stacx.tasks.tool_addition:ToolAdditionEnvironment", "max_turns": 3,
                               "a": 12, "b": 34}
    with pytest.raises(ValueError, match="only 8100 pairs are left"):
        tool_addition.addition_pairs(seed=0, count=9000)


def test_the_compact_template_keeps_the_protocol_and_brings_the_question_close():
    compact = build_tool_chat_tokenizer("qwen_compact")
    assert tool_call_style_for(compact) == "hermes"
    (call_row, answer_row) = tool_addition.transcript_rows([(12, 34)], compact)  # raises if ids do not round-trip
    assert call_row["prompt"] == ("<|im_start|>system\ntools: add(a,b)<|im_end|><|im_start|>user\n"
                                  "what is 12+34? use add<|im_end|><|im_start|>assistant\n")
    assert call_row["response"] == '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>'
    assert "<tool_response>\n46\n</tool_response>" in answer_row["prompt"] and answer_row["response"] == "46"
    rewards, session = play(compact, 12, 34, [call_row["response"], answer_row["response"]])
    assert rewards == [0.0, 1.0] and session.counts.tool_calls == 1 and session.counts.parse_errors == 0
    qwen = build_tool_chat_tokenizer("qwen")
    full = tool_addition.transcript_rows([(12, 34)], qwen)[0]["prompt"]
    num_tokens = [len(tok(text, add_special_tokens=False)["input_ids"]) for tok, text in ((compact, call_row["prompt"]),
                                                                                         (qwen, full))]
    assert num_tokens == [64, 426]  # the first reply follows 64 tokens instead of 426
