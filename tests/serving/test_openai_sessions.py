"""Sessions of the OpenAI-compatible endpoint: trees (scaffolds that retry, compact, start sub-agents)
and ownership (an episode's session refuses every other client and is never evicted).

Driven by the official `openai` client against a tiny random policy (what it generates does not
matter, only which ids are recorded and who may record them)."""

import logging

import pytest
import requests

from tests.deferred_import import deferred_import
from tests.rollout.agents.agent_fixtures import save_policy, tool_tokenizer
from tests.serving.fixtures import served_policy

openai = deferred_import("openai", "these tests drive the endpoint with the official openai client")


@pytest.fixture(scope="module")
def server(tmp_path_factory, single_process_world):
    tokenizer = tool_tokenizer()
    with served_policy(save_policy(tmp_path_factory.mktemp("sessions_policy"), tokenizer), tokenizer) as running:
        yield running


def template_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def output_ids(answer):
    return answer.model_extra["stacx"]["output_token_ids"]


def generated(sample):
    return [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]


def test_a_scaffold_that_retries_compacts_and_starts_a_sub_agent_is_one_episode_of_branches(server):
    """The scaffold drops a malformed reply and asks again with the format error, runs a sub-agent between
    two of its own turns, then compacts its history: one episode, three trajectories with its reward,
    each turn's ids the engine's own, every generated id trained exactly once."""
    from stacx.rollout.agents.agent_rollout import AgentRollout
    from stacx.rollout.agents.agent_trajectories import common_prefix_length

    tokenizer = server.tokenizer
    seen = {}

    def scaffold(base_url: str, task: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

        def ask(messages):
            return client.chat.completions.create(model="policy", messages=messages, max_tokens=5, seed=len(seen))

        start = [{"role": "system", "content": "use tools"}, {"role": "user", "content": task["task"]}]
        seen["malformed"] = ask(start)
        retry = start + [{"role": "user", "content": "format error: call a tool"}]     # the bad reply dropped
        seen["retry"] = ask(retry)
        seen["sub"] = ask([{"role": "system", "content": "you are a sub-agent"}, {"role": "user", "content": "look"}])
        go_on = retry + [seen["retry"].choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "go on"}]
        seen["go_on"] = ask(go_on)                                  # continues `retry`, not the sub-agent's turn
        compacted = start[:1] + [{"role": "user", "content": "summary: tried twice"}]
        seen["compacted"] = ask(compacted)
        seen["messages"] = {"retry": retry, "go_on": go_on, "compacted": compacted, "start": start}
        return 0.5

    rollout = AgentRollout(scaffold, server_url=server.url, api_key=server.api_key,
                           next_tasks=lambda step: [{"task": "fix it"}])
    samples, metrics = rollout.collect(0)
    messages = seen["messages"]
    assert [generated(s) for s in samples] == [
        output_ids(seen["malformed"]), output_ids(seen["retry"]) + output_ids(seen["go_on"]), output_ids(seen["sub"]),
        output_ids(seen["compacted"])]
    assert {(s.reward, s.group_index, s.episode_id) for s in samples} == {(0.5, 0, 0)}
    first, retried, sub, compacted = samples
    assert first.prompt_ids == template_ids(tokenizer, messages["start"])
    assert retried.prompt_ids == template_ids(tokenizer, messages["retry"])
    # token-in/token-out across the sub-agent's turn: the retry's prompt + its generated ids, then the template's
    head = retried.prompt_ids + output_ids(seen["retry"])
    assert retried.tokens[:len(head)] == head and retried.metadata["num_turns"] == 2
    assert sub.prompt_ids == template_ids(tokenizer, [{"role": "system", "content": "you are a sub-agent"},
                                                      {"role": "user", "content": "look"}])
    assert compacted.prompt_ids == template_ids(tokenizer, messages["compacted"])
    branch_points = [s.metadata["branch_point"] for s in samples]
    assert branch_points[1] == common_prefix_length(first.tokens, retried.prompt_ids) > 0
    assert branch_points[3] == max(common_prefix_length(s.tokens, compacted.prompt_ids) for s in samples[:3])
    assert metrics["rollout/agent_branches_per_episode"] == 3.0 and metrics["rollout/agent_samples"] == 4.0
    assert metrics["rollout/agent_tokens_reprefilled"] == float(sum(branch_points))


def chat(base_url, api_key="unused", **extra):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          **extra)


def error_text(response) -> str:
    """The error message, in Stacx's `{"error": text}` or OpenAI's `{"error": {"message": text}}` schema."""
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


def test_an_episodes_session_refuses_foreign_appends_reads_and_pops(server):
    url = server.url
    assert requests.post(f"{url}/stacx/sessions/episode-1", timeout=30).status_code == 401  # only the trainer opens
    trainer = {"Authorization": f"Bearer {server.api_key}"}
    opened = requests.post(f"{url}/stacx/sessions/episode-1", headers=trainer, timeout=30).json()
    secret = opened["secret"]
    assert opened["base_path"] == f"/sessions/episode-1/{secret}/v1" and len(secret) >= 32
    owner = f"{url}/sessions/episode-1/{secret}/v1"
    chat(owner)                                                   # the base URL the trainer gives the agent
    chat(f"{url}/sessions/episode-1/v1", api_key=secret)          # or the secret as the API key
    bare = {"messages": [{"role": "user", "content": "forged"}], "max_tokens": 2}

    # foreign appends: no secret (401), a wrong one in the key or the path (403); nothing is generated
    missing = requests.post(f"{url}/sessions/episode-1/v1/chat/completions", json=bare, timeout=30)
    assert missing.status_code == 401 and "belongs to an episode" in error_text(missing)
    assert missing.json()["error"]["type"] == "AuthenticationError" and missing.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.PermissionDeniedError) as refused:
        chat(f"{url}/sessions/episode-1/v1")
    assert "the secret is wrong" in error_text(refused.value.response)
    with pytest.raises(openai.PermissionDeniedError):
        chat(f"{url}/sessions/episode-1/{secret[:-1]}{'y' if secret.endswith('x') else 'x'}/v1")  # one character off
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=f"{url}/sessions/episode-1/x/v1", api_key="k", max_retries=0).completions.create(
            model="policy", prompt="forged", max_tokens=2)
    # foreign reads and pops
    unread = requests.get(f"{url}/stacx/sessions/episode-1", timeout=30)
    assert unread.status_code == 401 and isinstance(unread.json()["error"], str)  # Stacx's own schema off /v1/
    wrong = {"Authorization": "Bearer nope"}
    assert requests.get(f"{url}/stacx/sessions/episode-1", headers=wrong, timeout=30).status_code == 403
    assert requests.delete(f"{url}/stacx/sessions/episode-1", headers=wrong, timeout=30).status_code == 403
    assert requests.post(f"{url}/stacx/sessions/episode-1", headers=trainer, timeout=30).status_code == 409  # one owner

    key = {"Authorization": f"Bearer {secret}"}
    assert len(requests.get(f"{url}/stacx/sessions/episode-1", headers=key, timeout=30).json()["turns"]) == 2
    assert len(requests.delete(f"{url}/stacx/sessions/episode-1", headers=key, timeout=30).json()["turns"]) == 2
    with pytest.raises(openai.NotFoundError) as gone:   # a straggler after the episode ended
        chat(owner)
    assert "its episode is over" in error_text(gone.value.response)
    assert requests.get(f"{url}/stacx/sessions/episode-1", timeout=30).json()["turns"] == []
    # a session nobody opened stays open to whoever names it, whatever API key its client sends
    chat(f"{url}/sessions/loose-1/v1", api_key="anything")
    assert len(requests.get(f"{url}/stacx/sessions/loose-1", timeout=30).json()["turns"]) == 1
    stats = requests.get(f"{url}/stacx/sessions", timeout=30).json()
    assert stats["open_sessions"] == 0 and stats["other_sessions"] >= 1 and stats["evicted_sessions"] == 0


def test_a_flood_of_sessions_evicts_no_open_one_and_counts_and_warns_what_it_evicts(caplog):
    from stacx.serving.openai_sessions import SessionBook, SessionTurn
    from stacx.wire.trajectories import RecordedTurn

    def recorded(i):
        return SessionTurn(RecordedTurn(prompt_ids=(1, i), output_ids=(2,), output_log_probs=(-0.5,), weight_version=0))

    book = SessionBook(max_sessions=4096)
    live = {f"live-{i}": book.open(f"live-{i}") for i in range(3)}
    book.record("live-0", recorded(0), secret=live["live-0"])
    with caplog.at_level(logging.WARNING, logger="stacx.serving.openai_sessions"):
        for i in range(5000):
            book.record(f"flood-{i}", recorded(i))
            if i == 2500:  # a live episode keeps recording during the flood
                book.record("live-1", recorded(i), secret=live["live-1"])
    assert book.stats() == {"open_sessions": 3, "other_sessions": 4096, "evicted_sessions": 5000 - 4096}
    assert [len(book.turns(name, secret=secret)) for name, secret in live.items()] == [1, 1, 0]
    assert book.turns("flood-0") == [] and len(book.turns("flood-4999")) == 1   # the oldest loose ones went
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 10 and "904 dropped so far" not in warnings[-1] and "512 dropped so far" in warnings[-1]
    assert "never dropped" in warnings[0]


@pytest.mark.slow  # litellm's import alone is about 3 s of CPU
def test_mini_swe_agent_retrying_after_format_errors_is_one_episode_with_branches(server, tmp_path, monkeypatch):
    """mini-swe-agent, unmodified, drops a reply without a tool call and asks again with the format error
    (the untrained policy never writes one): one episode whose retries are branches of the first prompt."""
    from stacx.rollout.agents.agent_rollout import AgentRollout

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would download its price list
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea"))
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    try:
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.environments.local import LocalEnvironment
        from minisweagent.models.litellm_model import LitellmModel
    except ImportError as missing:  # a failure with the fix, never a skip
        raise ImportError("this test runs mini-swe-agent, in the test extra: pip install -e '.[test]'") from missing
    exits = []

    def agent(base_url: str, task: dict) -> float:
        model = LitellmModel(model_name="openai/policy", cost_tracking="ignore_errors",
                             format_error_template="format error: {{error}}",
                             model_kwargs={"api_base": base_url, "api_key": "unused", "temperature": 0.0,
                                           "max_tokens": 8})
        runner = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), system_template="You run bash.",
                              instance_template="{{task}}", step_limit=5, cost_limit=0)
        exits.append(runner.run(task["task"]).get("exit_status"))
        return 0.0

    rollout = AgentRollout(agent, server_url=server.url, api_key=server.api_key,
                           next_tasks=lambda step: [{"task": "Create done.txt"}])
    samples, metrics = rollout.collect(0)
    assert exits == ["RepeatedFormatError"]                    # three replies without a tool call, each retried
    assert len(samples) == 3 and {s.episode_id for s in samples} == {0}
    assert [s.metadata["branch_of"] for s in samples] == [None, 0, 1]
    # each retry's prompt is the previous one plus the format error: the branch leaves at the dropped reply
    generation_prompt = server.tokenizer("<|assistant|>", add_special_tokens=False)["input_ids"]
    for parent, branch in zip(samples, samples[1:]):
        assert parent.prompt_ids[-len(generation_prompt):] == generation_prompt
        assert branch.metadata["branch_point"] == len(parent.prompt_ids) - len(generation_prompt)
        text = server.tokenizer.decode(branch.prompt_ids[branch.metadata["branch_point"]:], skip_special_tokens=False)
        assert text.startswith("<|user|>format error: No tool calls found") and text.endswith("<|assistant|>")
    assert metrics["rollout/agent_branches_per_episode"] == 2.0
