"""`stacx serve`'s Anthropic Messages adapter, through the official `anthropic` client: a two-turn tool-use
conversation, streamed and not, recorded with the same ids as the same conversation through the OpenAI
route; stop reasons, stop strings, token counting, errors in Anthropic's schema, and the key in `x-api-key`.

The served policy is test_openai_endpoint.py's (`tests/serving/taught_policy.py`, taught once per pytest
run): a tiny model taught (a few SFT steps) to answer the task with a `touch done.txt` bash call and, after
its observation, the submit call; served greedily it makes both calls, so both turns end in `tool_use`.
"""

import json

import pytest
import requests

from tests.deferred_import import deferred_import
from tests.serving.taught_policy import SUBMIT, SYSTEM, TASK

anthropic = deferred_import("anthropic", "these tests drive the endpoint with the official anthropic client")
openai = deferred_import("openai", "these tests drive the endpoint with the official openai client")

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
ANTHROPIC_BASH = {"name": "bash", "description": "run a command", "input_schema": SCHEMA}
OPENAI_BASH = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": SCHEMA}}
GREEDY = {"temperature": 0}
"""Recent anthropic clients take sampling settings only as extra body fields."""
EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
          "message_stop"]


@pytest.fixture(scope="module")
def server(taught_server):
    return taught_server


def anthropic_client(server, session_id):
    return anthropic.Anthropic(base_url=f"{server.url}/sessions/{session_id}", api_key="any key", max_retries=0)


def recorded(server, session_id):
    from stacx.wire.trajectories import RecordedTurn

    answer = requests.get(f"{server.url}/stacx/sessions/{session_id}", timeout=30)
    answer.raise_for_status()
    return [RecordedTurn.from_json(t) for t in answer.json()["turns"]]


def anthropic_conversation(server, session_id, *, stream: bool):
    """The task, the bash call, its result "0", the next call: two turns through the anthropic client."""
    client = anthropic_client(server, session_id)
    messages, replies = [{"role": "user", "content": TASK}], []
    for _ in range(2):
        kwargs = dict(model="policy", max_tokens=120, system=SYSTEM, messages=messages, tools=[ANTHROPIC_BASH],
                      extra_body=GREEDY)
        if stream:
            with client.messages.stream(**kwargs) as events:
                seen = [event.type for event in events if event.type in EVENTS]
                reply = events.get_final_message()
            assert seen == ["message_start"] + ["content_block_start", "content_block_delta", "content_block_stop"] \
                + ["message_delta", "message_stop"], seen   # one tool_use block, its input in one input_json_delta
        else:
            reply = client.messages.create(**kwargs)
        replies.append(reply)
        messages = messages + [
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": reply.content[-1].id, "content": "0"}]}]
    return replies


@pytest.fixture(scope="module")
def openai_turns(server):
    """The same conversation through the official openai client and the OpenAI route: its recorded turns."""
    client = openai.OpenAI(base_url=f"{server.url}/sessions/openai-path/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[OPENAI_BASH], max_tokens=120,
                                               temperature=0).choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[-1].id, "content": "0"}]
    return recorded(server, "openai-path")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_two_turn_tool_use_conversation_records_what_the_openai_route_records(server, openai_turns, stream):
    from stacx.rollout.agents.agent_trajectories import assemble_trajectories

    session = f"anthropic-{'streamed' if stream else 'whole'}"
    first, second = anthropic_conversation(server, session, stream=stream)
    assert first.stop_reason == second.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in first.content] == [("tool_use", "bash", {"command": "touch done.txt"})]
    assert [(b.type, b.name, b.input) for b in second.content] == [("tool_use", "bash", {"command": SUBMIT})]

    turns = recorded(server, session)
    assert len(turns) == 2
    for reply, turn in zip((first, second), turns):
        assert reply.usage.input_tokens == len(turn.prompt_ids) and reply.usage.output_tokens == len(turn.output_ids)
        assert reply.model_extra["stacx"]["output_token_ids"] == list(turn.output_ids)
    # The same ids, turn by turn, as the OpenAI route recorded for the same conversation ...
    assert [(t.prompt_ids, t.output_ids, t.finish_reason) for t in turns] == \
        [(t.prompt_ids, t.output_ids, t.finish_reason) for t in openai_turns]
    for turn, reference in zip(turns, openai_turns):
        assert turn.output_log_probs == pytest.approx(reference.output_log_probs, abs=1e-6)
    # ... the second turn continuing the first's ids, so the session is one sample, equal to the OpenAI route's.
    (sample,) = assemble_trajectories(turns)
    (reference,) = assemble_trajectories(openai_turns)
    assert (sample.tokens, sample.loss_mask) == (reference.tokens, reference.loss_mask)
    assert sample.rollout_log_probs == pytest.approx(reference.rollout_log_probs, abs=1e-6)


def test_a_session_may_switch_apis_between_turns(server, openai_turns):
    """Turn 1 through the anthropic client, turn 2 through the openai client: the same turns again."""
    first = anthropic_client(server, "mixed").messages.create(
        model="policy", max_tokens=120, system=SYSTEM, messages=[{"role": "user", "content": TASK}],
        tools=[ANTHROPIC_BASH], extra_body=GREEDY)
    (call,) = first.content
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "0"}]
    client = openai.OpenAI(base_url=f"{server.url}/sessions/mixed/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="policy", messages=messages, tools=[OPENAI_BASH], max_tokens=120, temperature=0)
    turns = recorded(server, "mixed")
    assert [(t.prompt_ids, t.output_ids) for t in turns] == [(t.prompt_ids, t.output_ids) for t in openai_turns]


def test_stop_reasons_stop_sequences_and_token_counting(server):
    tokenizer = server.tokenizer
    client = anthropic_client(server, "stops")
    messages = [{"role": "user", "content": TASK}]
    asked = dict(model="policy", system=SYSTEM, tools=[ANTHROPIC_BASH], tool_choice={"type": "none"})
    counted = client.messages.count_tokens(**asked, messages=messages)
    # tool_choice none: the template still lists the tool, the text comes back as text
    stopped = client.messages.create(**asked, messages=messages, max_tokens=120,
                                     stop_sequences=['"arguments"', "never"], extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", '"arguments"')
    assert [(b.type, b.text) for b in stopped.content] == [("text", '<tool_call>{"name": "bash", ')]
    messages += [{"role": "assistant", "content": stopped.content[0].text}, {"role": "user", "content": "go on"}]
    counted_next = client.messages.count_tokens(**asked, messages=messages)
    cut = client.messages.create(**asked, messages=messages, max_tokens=5, extra_body=GREEDY)
    first, second = recorded(server, "stops")
    assert counted.input_tokens == len(first.prompt_ids) and counted_next.input_tokens == len(second.prompt_ids)
    # The recorded output ends with the ids that wrote the stop string: what the client saw, then the string;
    # the next turn continues those ids (the client's text without the string still continues the session).
    assert tokenizer.decode(list(first.output_ids)) == '<tool_call>{"name": "bash", "arguments"'
    assert first.finish_reason == "stop" and len(first.output_log_probs) == len(first.output_ids)
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    assert tokenizer.decode(list(second.prompt_ids[len(first.prompt_ids) + len(first.output_ids):])) == \
        "<eos><|user|>go on<eos><|assistant|>"
    assert (cut.stop_reason, cut.usage.output_tokens, len(second.output_ids)) == ("max_tokens", 5, 5)


def test_errors_come_in_anthropics_schema_with_the_servers_message(server):
    client = anthropic_client(server, "errors")
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"top_k": 3})
    assert refused.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "/v1/messages: 'top_k' is not supported (got 3); leave it out, use temperature and top_p"}}
    assert "'top_k' is not supported" in str(refused.value)   # what the client shows its user
    bad_session = requests.post(f"{server.url}/sessions/a%20b/v1/messages", timeout=30,
                                json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert bad_session.status_code == 400 and bad_session.json()["error"]["type"] == "invalid_request_error"
    assert "session id" in bad_session.json()["error"]["message"]
    assert recorded(server, "errors") == []
    unsessioned = requests.post(f"{server.url}/v1/messages", json={"messages": []}, timeout=30)
    assert unsessioned.status_code == 400 and "'max_tokens' is required" in unsessioned.json()["error"]["message"]


def test_x_api_key_carries_the_servers_key_where_it_is_checked():
    from stacx.serving.server import EngineHttpServer

    with EngineHttpServer(None, api_key="the-key") as keyed:
        wrong = requests.post(f"{keyed.url}/pause_generation", headers={"x-api-key": "a guess"}, timeout=30)
        missing = requests.post(f"{keyed.url}/pause_generation", timeout=30)
        right = requests.post(f"{keyed.url}/continue_generation", headers={"x-api-key": "the-key"}, timeout=30)
    assert (wrong.status_code, missing.status_code, right.status_code) == (403, 401, 200)
    assert "x-api-key" in missing.json()["error"]


def test_an_agent_command_gets_the_session_url_for_anthropic_clients_too():
    import sys

    from stacx.rollout.agents.agent_rollout import AgentCommand

    report = ("import json, os; open(os.environ['STACX_REWARD_FILE'], 'w').write(json.dumps({'reward': float("
              "os.environ['ANTHROPIC_BASE_URL'] == 'http://127.0.0.1:1/sessions/s1' and "
              "bool(os.environ['ANTHROPIC_API_KEY']))}))")
    assert AgentCommand(argv=(sys.executable, "-c", report))("http://127.0.0.1:1/sessions/s1/v1", {}) == 1.0
