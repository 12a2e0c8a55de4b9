"""`stacx serve`'s OpenAI-compatible endpoint, through the official `openai` client: chat with tools,
completions, sessions recorded token-in/token-out, and a GRPO step trained on an agent's sessions."""

import json

import pytest
import requests
import torch

from tests.rollout.agent_fixtures import BASH_TOOL, save_policy, tool_tokenizer, train_one_grpo_step

openai = pytest.importorskip("openai", reason="the test extra installs openai: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tokenizer = tool_tokenizer()
    return save_policy(tmp_path_factory.mktemp("agent_policy"), tokenizer), tokenizer


@pytest.fixture(scope="module")
def server(policy, single_process_world):
    from stacx.rollout.engines.cpu import CpuEngine
    from stacx.rollout.engines.server import EngineHttpServer

    path, tokenizer = policy
    with EngineHttpServer(CpuEngine.from_hf_checkpoint(path), model_path=path, tokenizer=tokenizer) as running:
        yield running


def client_for(server, session_id=None):
    base_url = f"{server.url}/sessions/{session_id}/v1" if session_id else f"{server.url}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def recorded(server, session_id):
    from stacx.rollout.agent_trajectories import RecordedTurn

    answer = requests.get(f"{server.url}/stacx/sessions/{session_id}", timeout=30)
    answer.raise_for_status()
    return [RecordedTurn.from_json(t) for t in answer.json()["turns"]]


def test_chat_with_tools_continues_the_engines_own_ids_across_turns(server, policy):
    from stacx.rollout.agent_trajectories import assemble_trajectories

    _, tokenizer = policy
    client = client_for(server, "chat-1")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[BASH_TOOL], max_tokens=12,
                                           temperature=1.0, seed=3, logprobs=True)
    reply = first.choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "and now?"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=[BASH_TOOL], max_tokens=6,
                                            seed=4)
    turns = recorded(server, "chat-1")
    assert len(turns) == 2
    # Turn 1's prompt is the template's rendering, tools included; its output is what the client got.
    assert turns[0].prompt_ids == tuple(tokenizer.apply_chat_template(
        messages[:2], tools=[BASH_TOOL], tokenize=True, add_generation_prompt=True, return_dict=False))
    assert list(turns[0].output_ids) == first.model_extra["stacx"]["output_token_ids"]
    assert [entry.logprob for entry in first.choices[0].logprobs.content] == pytest.approx(turns[0].output_log_probs)
    assert first.usage.prompt_tokens == len(turns[0].prompt_ids)
    # Turn 2 extends turn 1's prompt and generated ids (never re-tokenized) with the template's new ids.
    head = turns[0].prompt_ids + turns[0].output_ids
    assert turns[1].prompt_ids[:len(head)] == head
    between = tokenizer.decode(list(turns[1].prompt_ids[len(head):]), skip_special_tokens=False)
    ended_on_eos = turns[0].output_ids[-1:] == (tokenizer.eos_token_id,)
    assert between == ("" if ended_on_eos else "<eos>") + "<|user|>and now?<eos><|assistant|>"
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    (sample,) = assemble_trajectories(turns)
    assert sample.tokens == list(turns[1].prompt_ids + turns[1].output_ids)
    num_between = len(turns[1].prompt_ids) - len(head)
    assert sample.loss_mask == [1] * len(turns[0].output_ids) + [0] * num_between + [1] * len(turns[1].output_ids)


def test_a_rewritten_history_is_rendered_whole_and_unsessioned_calls_are_not_recorded(server, policy):
    _, tokenizer = policy
    client = client_for(server, "chat-2")
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1)
    edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "not what you said"},
              {"role": "user", "content": "ok"}]
    client.chat.completions.create(model="policy", messages=edited, max_tokens=4, seed=2)
    client_for(server).chat.completions.create(model="policy", messages=edited, max_tokens=4, seed=2)
    turns = recorded(server, "chat-2")
    assert len(turns) == 2
    assert turns[1].prompt_ids == tuple(tokenizer.apply_chat_template(edited, tokenize=True, add_generation_prompt=True,
                                                                      return_dict=False))
    answer = requests.delete(f"{server.url}/stacx/sessions/chat-2", timeout=30).json()
    assert len(answer["turns"]) == 2 and recorded(server, "chat-2") == []


def test_completions_return_the_engine_ids_and_continue_a_session_prompt(server, policy):
    _, tokenizer = policy
    client = client_for(server, "text-1")
    first = client.completions.create(model="policy", prompt="count: 1 2", max_tokens=5, seed=7, logprobs=0)
    ids = first.model_extra["stacx"]["output_token_ids"]
    assert first.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(first.choices[0].logprobs.token_logprobs) == len(ids)
    client.completions.create(model="policy", prompt="count: 1 2" + first.choices[0].text + " 3", max_tokens=3, seed=8)
    turns = recorded(server, "text-1")
    assert turns[1].prompt_ids[:len(turns[0].prompt_ids) + len(ids)] == turns[0].prompt_ids + tuple(ids)


@pytest.mark.parametrize("field, value, named", [
    ("stop", ["\n"], "'stop' strings are not supported"),
    ("stream", True, "'stream': true is not supported"),
    ("n", 2, "'n' must be 1"),
    ("frobnicate", 1, "unsupported fields ['frobnicate']"),
    ("messages", [{"role": "wizard", "content": "x"}], "'messages[0].role' must be one of"),
])
def test_unsupported_requests_get_a_400_naming_the_field(server, field, value, named):
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], field: value}
    answer = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and named in answer.json()["error"]
    bad_session = requests.post(f"{server.url}/sessions/a%20b/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert bad_session.status_code == 400 and "session id" in bad_session.json()["error"]
    assert client_for(server).models.list().data[0].owned_by == "stacx"


def test_a_grpo_step_trains_on_an_agents_sessions_with_the_engines_ids(server, tmp_path):
    """AgentRollout runs a two-turn agent (the openai client) per task; the real loop trains one GRPO step on
    the assembled sessions, and its recomputed log-probs of the generated ids equal the engine's."""
    from stacx.rollout.agent_rollout import AgentRollout

    def agent(base_url: str, task: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, logprobs=True)
        return -sum(entry.logprob for entry in second.choices[0].logprobs.content)  # varies with every sample

    tasks = [{"question": "1+1?"}, {"question": "2*3?"}]
    rollout = AgentRollout(agent, server_url=server.url, next_tasks=lambda step: tasks, n_samples_per_task=2,
                           max_parallel_episodes=4)
    batch, metrics = train_one_grpo_step(server, rollout, tmp_path, num_tasks=2, n_samples_per_task=2)
    assert batch.num_samples == 4 and batch.prompt_id == [0, 0, 1, 1]
    assert len(set(batch.rewards[:2])) > 1 or len(set(batch.rewards[2:])) > 1, "every group uniform: nothing to learn"
    assert metrics["test/weights_changed"] == 1.0 and metrics["rollout/agent_turns_mean"] == 2.0
