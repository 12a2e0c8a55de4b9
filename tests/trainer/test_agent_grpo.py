"""Multi-turn agent episodes train through GRPO: the custom environment of examples/agent_environment
(loaded with --custom-module), a tiny policy with a Qwen-style tool chat template served in this
process, the torchrun loop on one forked gloo rank (no Ray). Checks: the dumped trajectories mask
exactly the model's tokens, the per-episode counts reach the `agent/*` metrics, rewards vary so the
policy gets a gradient, and the trainer's log-probs of the trained tokens equal the engine's (zero
drift end to end: a re-tokenized trajectory would score other tokens); its --dump-rollouts replayed with no
engine and no environment trains to bitwise the same losses and weights. Then, on the same server, an
external agent given with --agent (a file:function using the official openai client, two turns per
episode) is the rollout: its sessions train one GRPO step, scored by a --reward-fn file function."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from stacx.testing.distributed import run_distributed
from tests.trainer.training_fixtures import ATTACHED_SERVER_KEY, read_metrics, read_rollout_dumps, run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_environment", "letter_count.py")
WORDS = (("banana", "a"), ("letter", "t"))


def train_grpo_on_episodes(groups, root: str, url: str):
    """The episodes' run, dumping its batches (--dump-rollouts), then its replay with no engine, environment
    or sandbox (--replay-rollouts), in this rank on a fresh process group."""
    from stacx.testing.distributed import find_free_port
    from stacx.trainer.spmd import run_spmd

    values = dict(algorithm={"off_policy_corrections": "token_tis"}, train={"algorithm": "grpo"},
                  hf_checkpoint=os.path.join(root, "policy"), custom_module=[os.path.abspath(EXAMPLE)],
                  rollout_engine="http", rollout_batch_size=2, n_samples_per_prompt=4, rollout_max_response_len=6,
                  rollout_temperature=1.0, max_tokens_per_micro_batch=4096, num_steps=2)
    run_spmd(run_config(root, **values, prompt_data=os.path.join(root, "episodes.jsonl"), rollout_urls=[url],
                        save_rollouts_per_step=100, dump_rollouts=os.path.join(root, "dump"),
                        save=os.path.join(root, "ckpt")))
    os.environ["MASTER_PORT"] = str(find_free_port())  # the first run's teardown destroyed the process group
    run_spmd(run_config(root, **values, replay_rollouts=os.path.join(root, "dump"),
                        save=os.path.join(root, "ckpt_replay"), out=os.path.join(root, "out_replay")))


AGENT_FILE = """
import openai


def two_turns(base_url, task):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "again"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    return None  # --reward-fn scores the last turn


def length_reward(response, label, metadata):
    return float(len(response) % 3)
"""


def train_grpo_on_agent_sessions(groups, root: str, url: str):
    from stacx.trainer.spmd import run_spmd

    agent = os.path.join(root, "my_agent.py")
    values = dict(train={"algorithm": "grpo"}, hf_checkpoint=os.path.join(root, "policy"),
                  prompt_data=os.path.join(root, "episodes.jsonl"), agent=f"{agent}:two_turns",
                  reward_fn=f"{agent}:length_reward", rollout_engine="http", rollout_urls=[url],
                  rollout_batch_size=2, n_samples_per_prompt=4, max_tokens_per_micro_batch=4096, num_steps=1,
                  out=os.path.join(root, "out_agent"))
    return run_spmd(run_config(root, **values))


def test_grpo_trains_on_multi_turn_tool_episodes(tmp_path, monkeypatch):
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer

    root = str(tmp_path)
    tokenizer = build_tool_chat_tokenizer("qwen")
    policy = os.path.join(root, "policy")
    save_tiny_hf_checkpoint(policy, "llama", seed=0, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            max_position_embeddings=1024)
    tokenizer.save_pretrained(policy)
    with open(os.path.join(root, "episodes.jsonl"), "w") as f:
        for word, letter in WORDS:
            f.write(json.dumps({"prompt": "count", "metadata": {"environment": "letter_count", "max_turns": 3,
                                                                 "word": word, "letter": letter}}) + "\n")
    ensure_single_process_layout()
    server = EngineHttpServer(CpuEngine.from_hf_checkpoint(policy, seed=3), api_key=ATTACHED_SERVER_KEY,
                              tokenizer=tokenizer).start()
    try:
        monkeypatch.setenv("STACX_API_KEY", ATTACHED_SERVER_KEY)
        run_distributed(train_grpo_on_episodes, 1, args=(root, server.url), timeout_s=240)
    finally:
        server.stop()
    # A fresh server (the first run moved its weight version on): the agent's run starts at version 0.
    server = EngineHttpServer(CpuEngine.from_hf_checkpoint(policy, seed=3), api_key=ATTACHED_SERVER_KEY,
                              tokenizer=tokenizer).start()
    try:
        with open(os.path.join(root, "my_agent.py"), "w") as f:
            f.write(AGENT_FILE)
        run_distributed(train_grpo_on_agent_sessions, 1, args=(root, server.url), timeout_s=240)
    finally:
        server.stop()
        destroy_parallel_layout()
    rows, dumps = read_metrics(os.path.join(root, "out")), read_rollout_dumps(os.path.join(root, "out"))
    assert [row["step"] for row in rows] == [0, 1]
    episodes = [row for step in (0, 1) for row in dumps[step]]
    assert len(episodes) == 16
    for row in episodes:
        counts = row["metadata"]["episode"]
        assert row["loss_mask"] == [int(e == 1) for e in row["executors"]]  # model tokens only, all the model's
        assert 1 <= counts["turns"] <= 3 and row["reward"] == pytest.approx(sum(counts["turn_rewards"]))
        assert len(row["metadata"]["turn_executors"]) == counts["turns"]
        if counts["turns"] > 1:  # an observation (environment tokens) sits between the turns
            assert 0 in row["executors"] and "user\nReply with the count as a number." in row["response_text"]
    assert any(row["metadata"]["episode"]["turns"] > 1 for row in episodes)
    for step, row in enumerate(rows):
        assert row["agent/episodes"] == 8.0
        turns = [r["metadata"]["episode"]["turns"] for r in dumps[step]]
        assert row["agent/turns_mean"] == pytest.approx(sum(turns) / len(turns))
        for name in ("tool_calls", "parse_errors", "tool_errors", "tool_timeouts"):
            assert row[f"agent/{name}"] == sum(r["metadata"]["episode"][name] for r in dumps[step])
        assert math.isfinite(row["policy/loss"])
    assert any(len({r["reward"] for r in dumps[s] if r["metadata"]["turn_executors"]}) > 1 for s in (0, 1))
    assert any(row["policy/grad_norm"] > 0 for row in rows)
    # Step 0 trains the weights that generated it: the trainer's log-probs of the dumped tokens are the
    # engine's (float32 rounding apart) only if the tokens are the engine's own.
    assert rows[0]["policy/mismatch_abs_log_ratio"] < 1e-3

    # The replay of the dumped episodes (no engine, no environment) trains to the same losses and weights.
    replayed = read_metrics(os.path.join(root, "out_replay"))
    for name in ("policy/loss", "policy/grad_norm"):
        assert [row[name] for row in replayed] == [row[name] for row in rows], name
    from tests.checkpointing.helpers import read_torch_dist_tensors

    original, replay = (read_torch_dist_tensors(os.path.join(root, run, "step_000000002", "roles", "policy", "model"))
                        for run in ("ckpt", "ckpt_replay"))
    assert original.keys() == replay.keys() and all(torch.equal(original[k], replay[k]) for k in original)
    from stacx.trainer.rollout_dump import RolloutReplay

    dumped, _ = RolloutReplay(os.path.join(root, "dump")).read(0)
    assert dumped.executors[0].tolist() == dumps[0][0]["executors"]  # environment tokens kept

    # --agent: the external agent's two-turn sessions are the samples; the trained ids are the engine's.
    (agent_row,) = read_metrics(os.path.join(root, "out_agent"))
    assert agent_row["rollout/agent_episodes"] == 8.0 and agent_row["rollout/agent_failed_episodes"] == 0.0
    assert agent_row["rollout/agent_turns_mean"] == 2.0
    assert agent_row["policy/mismatch_abs_log_ratio"] < 1e-3
    assert agent_row["policy/grad_norm"] > 0  # the --reward-fn scores differed within a group
    # Its rollouts.jsonl, as every run's: each dumped episode's turns (the model's, what came back) and reward.
    agent_dumps = read_rollout_dumps(os.path.join(root, "out_agent"))[0]
    assert len(agent_dumps) == 4 and all(isinstance(row["reward"], float) for row in agent_dumps)
    assert all([turn["role"] for turn in row["turns"]][:3] == ["model", "observation", "model"] for row in agent_dumps)
