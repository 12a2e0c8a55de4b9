"""The OpenAI endpoint's pure parts: tool-call parsing, request checks, token-in/token-out prompts,
and AgentRollout's episode bookkeeping (no server, no model)."""

import sys

import pytest

from stacx.rollout.agent_rollout import AgentCommand, AgentRollout
from stacx.rollout.agent_trajectories import RecordedTurn
from stacx.rollout.engines.openai_protocol import parse_chat_request, parse_completion_request, template_messages
from stacx.rollout.engines.openai_sessions import SessionBook, SessionTurn, chat_prompt_ids, completion_prompt_ids
from stacx.rollout.tool_calls import parse_tool_calls
from tests.rollout.agent_fixtures import BASH_TOOL, tool_tokenizer


def test_hermes_tool_calls_are_split_from_the_content_and_a_malformed_one_is_reported_alone():
    text = ('let me look <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
            '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
            '<tool_call>{"name": "bash", "arguments": [1]}</tool_call><tool_call>not json')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "let me look"
    assert [(c.name, c.arguments) for c in parsed.calls] == [("bash", {"command": "ls"}), ("bash", {"command": "pwd"})]
    assert len({c.call_id for c in parsed.calls}) == 2
    assert [e.split(":")[0] for e in parsed.errors] == ["tool call 2 (bash)", "tool call 3"]
    assert parse_tool_calls("plain", "hermes").calls == ()
    with pytest.raises(ValueError, match="tool call style 'xml' is unknown"):
        parse_tool_calls("x", "xml")


def test_requests_are_read_with_openai_defaults_and_tool_arguments_become_objects_for_the_template():
    chat = parse_chat_request({"model": "m", "user": "u", "stream": False, "max_completion_tokens": 7,
                               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                            {"role": "assistant", "content": None, "tool_calls": [
                                                {"id": "c", "type": "function",
                                                 "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]}],
                               "tools": [BASH_TOOL], "tool_choice": "none"})
    assert (chat.sampling.max_tokens, chat.sampling.temperature, chat.use_tools, chat.logprobs) == (7, 1.0, False, False)
    rendered = template_messages(chat.messages)
    assert rendered[0]["content"] == "hi" and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
    completion = parse_completion_request({"prompt": ["count"], "max_tokens": 3, "logprobs": 0, "seed": 5})
    assert (completion.prompt, completion.sampling.seed, completion.logprobs) == ("count", 5, True)
    for body, named in [({"prompt": ""}, "'prompt' must be"), ({"prompt": "x", "temperature": 3}, "'temperature'"),
                        ({"prompt": "x", "logprobs": 5}, "'logprobs' must be 0"),
                        ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer >= 1")]:
        with pytest.raises(ValueError, match=named):
            parse_completion_request(body)
    bad_arguments = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "b", "arguments": "{"}}]}]}
    with pytest.raises(ValueError, match=r"'messages\[0\].tool_calls\[0\].function.arguments' is not JSON"):
        parse_chat_request(bad_arguments)


@pytest.fixture(scope="module")
def tokenizer():
    return tool_tokenizer()


def ids(tokenizer, text):
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("generated, close", [("ok<eos>", ""), ("ok", "<eos>")])
def test_a_continuing_chat_keeps_the_generated_ids_and_adds_only_the_close_it_lacks(tokenizer, generated, close):
    first = [{"role": "user", "content": "hi"}]
    prompt, continued = chat_prompt_ids(tokenizer, first, [BASH_TOOL], None)
    assert tokenizer.decode(prompt, skip_special_tokens=False) == "<|system|>tools: bash<eos><|user|>hi<eos><|assistant|>"
    assert not continued
    # The engine's ids for "ok" are not the template's (here: a reversed pair), so re-tokenizing would lose them.
    output = tuple(reversed(ids(tokenizer, "ok"))) + ids(tokenizer, generated[2:])
    previous = SessionTurn(RecordedTurn(prompt_ids=tuple(prompt), output_ids=output, output_log_probs=(0.0,) * len(output),
                                        weight_version=0), messages=first, reply={"role": "assistant", "content": "ok"})
    second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    prompt2, continued = chat_prompt_ids(tokenizer, second, [BASH_TOOL], previous)
    assert continued and tuple(prompt2[:len(prompt) + len(output)]) == tuple(prompt) + output
    assert tokenizer.decode(prompt2[len(prompt) + len(output):], skip_special_tokens=False) == \
        close + "<|user|>more<eos><|assistant|>"
    changed_reply = first + [{"role": "assistant", "content": "OK"}, {"role": "user", "content": "more"}]
    prompt3, continued = chat_prompt_ids(tokenizer, changed_reply, [BASH_TOOL], previous)
    assert not continued and tuple(prompt3) == ids(tokenizer, tokenizer.apply_chat_template(
        changed_reply, tools=[BASH_TOOL], tokenize=False, add_generation_prompt=True))


def test_a_completion_extending_the_last_prompt_and_completion_keeps_their_ids(tokenizer):
    turn = RecordedTurn(prompt_ids=(9, 8), output_ids=(7,), output_log_probs=(0.0,), weight_version=0)
    previous = SessionTurn(turn, text="ab" + "c")
    assert completion_prompt_ids(tokenizer, "abcd", previous) == [9, 8, 7, *ids(tokenizer, "d")]
    assert completion_prompt_ids(tokenizer, "xbcd", previous) == list(tokenizer.encode("xbcd"))
    assert completion_prompt_ids(tokenizer, [4, 5], previous) == [4, 5]


def test_the_session_book_forgets_the_oldest_sessions_and_hands_turns_over_once():
    book = SessionBook(max_sessions=2)
    turn = RecordedTurn(prompt_ids=(1,), output_ids=(2,), output_log_probs=(0.0,), weight_version=0)
    for session in ("a", "b", "c"):
        book.record(session, SessionTurn(turn, messages=[{"role": "user", "content": session}]))
    book.record("c", SessionTurn(turn, messages=[]))
    assert book.turns("a") == [] and book.turns("c") == [turn, turn]
    assert book.last("c").messages == [] and book._sessions["c"][0].messages is None  # older turns keep ids only
    assert book.turns("c", remove=True) == [turn, turn] and book.turns("c") == []


def test_a_failing_episode_keeps_its_turns_with_reward_zero_and_a_missing_reward_is_an_error(monkeypatch):
    turn = RecordedTurn(prompt_ids=(1, 2), output_ids=(3,), output_log_probs=(-0.5,), weight_version=1)

    def crashing(base_url, task):
        assert "/sessions/" in base_url and base_url.endswith("/v1")
        raise RuntimeError("scaffold crashed")

    rollout = AgentRollout(crashing, server_url="http://127.0.0.1:1", next_tasks=lambda step: [{"q": 1}])
    monkeypatch.setattr(rollout, "take_turns", lambda session_id: [turn])
    samples, metrics = rollout.collect(0)
    assert [(s.reward, s.reward_error) for s in samples] == [(0.0, "RuntimeError: scaffold crashed")]
    assert metrics["rollout/agent_failed_episodes"] == 1.0
    silent = AgentRollout(lambda base_url, task: None, server_url="http://127.0.0.1:1", next_tasks=lambda step: [{}])
    monkeypatch.setattr(silent, "take_turns", lambda session_id: [turn])
    with pytest.raises(ValueError, match="returned no reward and AgentRollout has no reward_fn"):
        silent.collect(0)
    monkeypatch.setattr(silent, "take_turns", lambda session_id: [])
    with pytest.raises(RuntimeError, match="none of the 1 agent episodes made a model call"):
        silent.collect(0)


def test_an_agent_command_gets_the_base_url_and_task_and_reports_its_reward():
    script = ("import json, os, sys; task = json.loads(os.environ['STACX_TASK']); "
              "print('working'); open(os.environ['STACX_REWARD_FILE'], 'w').write(json.dumps({'reward': task['x'] + "
              "len(sys.argv[1]) + (os.environ['OPENAI_BASE_URL'] == sys.argv[1])}))")
    command = AgentCommand(argv=(sys.executable, "-c", script, "{base_url}"))
    assert command("http://h/sessions/s/v1", {"x": 2}) == 2 + len("http://h/sessions/s/v1") + 1
    failing = AgentCommand(argv=(sys.executable, "-c", "import sys; sys.exit('no tools')"))
    with pytest.raises(RuntimeError, match="exited with 1: no tools"):
        failing("http://h", {})
    with pytest.raises(ValueError, match="AgentCommand.argv is empty"):
        AgentCommand(argv=())
