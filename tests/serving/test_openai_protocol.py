"""The OpenAI endpoint's pure parts: tool-call parsing, request checks, token-in/token-out prompts,
and AgentRollout's episode bookkeeping (no server, no model)."""

import re
import sys

import pytest

from stacx.rollout.agents.agent_rollout import AgentCommand, AgentRollout
from stacx.serving.openai_protocol import parse_chat_request, parse_completion_request, template_messages
from stacx.serving.openai_sessions import SessionBook, SessionTurn, chat_prompt_ids, completion_prompt_ids
from stacx.wire.tool_calls import parse_tool_calls
from stacx.wire.trajectories import RecordedTurn
from tests.rollout.agents.agent_fixtures import BASH_TOOL, tool_tokenizer


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
                        ({"prompt": "x", "logprobs": 21}, "'logprobs' must be at most 20"),
                        ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer in \\[1, ")]:
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
    prompt, continued = chat_prompt_ids(tokenizer, first, [BASH_TOOL], [])
    assert tokenizer.decode(prompt, skip_special_tokens=False) == "<|system|>tools: bash<eos><|user|>hi<eos><|assistant|>"
    assert not continued
    # The engine's ids for "ok" are not the template's (here: a reversed pair), so re-tokenizing would lose them.
    output = tuple(reversed(ids(tokenizer, "ok"))) + ids(tokenizer, generated[2:])
    previous = SessionTurn(RecordedTurn(prompt_ids=tuple(prompt), output_ids=output, output_log_probs=(0.0,) * len(output),
                                        weight_version=0), messages=first, reply={"role": "assistant", "content": "ok"})
    second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    prompt2, continued = chat_prompt_ids(tokenizer, second, [BASH_TOOL], [previous])
    assert continued is previous and tuple(prompt2[:len(prompt) + len(output)]) == tuple(prompt) + output
    assert tokenizer.decode(prompt2[len(prompt) + len(output):], skip_special_tokens=False) == \
        close + "<|user|>more<eos><|assistant|>"
    changed_reply = first + [{"role": "assistant", "content": "OK"}, {"role": "user", "content": "more"}]
    prompt3, continued = chat_prompt_ids(tokenizer, changed_reply, [BASH_TOOL], [previous])
    assert not continued and tuple(prompt3) == ids(tokenizer, tokenizer.apply_chat_template(
        changed_reply, tools=[BASH_TOOL], tokenize=False, add_generation_prompt=True))


def test_a_completion_extending_the_last_prompt_and_completion_keeps_their_ids(tokenizer):
    turn = RecordedTurn(prompt_ids=(9, 8), output_ids=(7,), output_log_probs=(0.0,), weight_version=0)
    previous = SessionTurn(turn, text="ab" + "c")
    assert completion_prompt_ids(tokenizer, "abcd", [previous]) == ([9, 8, 7, *ids(tokenizer, "d")], previous)
    assert completion_prompt_ids(tokenizer, "xbcd", [previous]) == (list(tokenizer.encode("xbcd")), None)
    assert completion_prompt_ids(tokenizer, [4, 5], [previous]) == ([4, 5], None)


def test_the_session_book_forgets_the_oldest_sessions_and_hands_turns_over_once():
    book = SessionBook(max_sessions=2)
    turn = RecordedTurn(prompt_ids=(1,), output_ids=(2,), output_log_probs=(0.0,), weight_version=0)
    for session in ("a", "b", "c"):
        book.record(session, SessionTurn(turn, messages=[{"role": "user", "content": session}]))
    first = book.last("c")
    book.record("c", SessionTurn(turn, messages=[]), continued=first)
    assert book.turns("a") == [] and book.turns("c") == [turn, turn] and book.evicted == 1
    assert [leaf.messages for leaf in book.leaves("c")] == [[]]   # the continued turn is no longer a leaf
    book.record("c", SessionTurn(turn, messages=[{"role": "user", "content": "retry"}]))   # a branch: two leaves
    assert [leaf.messages for leaf in book.leaves("c")] == [[{"role": "user", "content": "retry"}], []]
    assert book.turns("c", remove=True) == [turn] * 3 and book.turns("c") == []


def test_a_failing_episode_keeps_its_turns_with_reward_zero_and_a_missing_reward_is_an_error(monkeypatch):
    turn = RecordedTurn(prompt_ids=(1, 2), output_ids=(3,), output_log_probs=(-0.5,), weight_version=1)

    def crashing(base_url, task):
        assert "/sessions/" in base_url and base_url.endswith("/v1")
        raise RuntimeError("scaffold crashed")

    rollout = AgentRollout(crashing, server_url="http://127.0.0.1:1", next_tasks=lambda step: [{"q": 1}])
    monkeypatch.setattr(AgentRollout, "open_session", lambda self, server_url=None: ("s", "secret"))
    monkeypatch.setattr(rollout, "take_turns", lambda session_id, secret, server_url=None: [turn])
    samples, metrics = rollout.collect(0)
    assert [(s.reward, s.reward_error) for s in samples] == [(0.0, "RuntimeError: scaffold crashed")]
    assert metrics["rollout/agent_failed_episodes"] == 1.0
    silent = AgentRollout(lambda base_url, task: None, server_url="http://127.0.0.1:1", next_tasks=lambda step: [{}])
    monkeypatch.setattr(silent, "take_turns", lambda session_id, secret, server_url=None: [turn])
    with pytest.raises(ValueError, match="returned no reward and AgentRollout has no reward_fn"):
        silent.collect(0)
    monkeypatch.setattr(silent, "take_turns", lambda session_id, secret, server_url=None: [])
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


def test_a_stop_string_cuts_the_text_before_it_and_the_ids_after_the_ones_that_wrote_it(tokenizer):
    from stacx.serving.openai_stop import parse_stop
    from stacx.serving.stop_sequences import cut_at_stop_sequences
    from stacx.wire.types import GenerateOutput

    generated = list(ids(tokenizer, "ab\nEND more"))
    output = GenerateOutput(output_ids=generated, output_log_probs=[-float(i) for i in range(len(generated))],
                            output_token_versions=[3] * len(generated), weight_version=3, finish_reason="length")
    decode = lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)  # noqa: E731
    cut = cut_at_stop_sequences(output, ("zzz", "\nE", "more"), decode)
    assert (cut.text, cut.stop_sequence, cut.output.finish_reason) == ("ab", "\nE", "stop")
    assert cut.output.output_ids == list(ids(tokenizer, "ab\nE"))  # the ids that wrote the stop string included
    assert cut.output.output_log_probs == [0.0, -1.0, -2.0, -3.0] and cut.output.output_token_versions == [3] * 4
    kept = cut_at_stop_sequences(output, ("zzz",), decode)
    assert kept.stop_sequence is None and kept.output is output and output.output_ids == generated  # not changed
    assert parse_stop("x", "/v1/completions") == ("x",)
    for value, named in [(["a"] * 5, "at most 4 strings, got 5"), ([""], "non-empty"), (3, "'stop' must be")]:
        with pytest.raises(ValueError, match=named):
            parse_stop(value, "/v1/completions")


def test_a_forced_call_opens_as_the_template_writes_a_call(tokenizer):
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.serving.openai_tool_choice import forced_call_opening

    second = {"type": "function", "function": {"name": "submit"}}
    assert forced_call_opening(tokenizer, [BASH_TOOL, second], None) == "<tool_call>"
    named = forced_call_opening(tokenizer, [BASH_TOOL, second], "submit")
    assert named == '<tool_call>{"name": "submit", "arguments": '
    with pytest.raises(ValueError, match="'tool_choice': the served chat template does not write a tool call"):
        forced_call_opening(build_char_tokenizer(), [BASH_TOOL], None)  # its template renders no calls


@pytest.mark.parametrize("body, named", [
    ({"tool_choice": "required"}, "'tool_choice' \"required\" needs 'tools'"),
    ({"tools": [BASH_TOOL], "tool_choice": {"type": "function", "function": {"name": "ls"}}},
     "names the function 'ls', which is not in 'tools'"),
    ({"tools": [BASH_TOOL], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"top_logprobs": 5}, "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be at most 20"),
    ({"stream_options": {"include_usage": True}}, "'stream_options' can only be given with 'stream': true"),
    ({"n": 65}, "'n' must be at most 64"),
    ({"n": 0}, "'n' must be an integer in [1, "),
    ({"seed": 2**70}, "'seed' must be an integer in [0, "),  # was accepted, then a 500 from torch's generator
])
def test_vllms_request_checks_name_the_field(body, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body})


def test_the_new_fields_are_read():
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "n": 4, "stop": "\n", "seed": 3,
                               "logprobs": True, "top_logprobs": 5, "stream": True,
                               "stream_options": {"include_usage": True}, "tools": [BASH_TOOL],
                               "tool_choice": {"type": "function", "function": {"name": "bash"}}})
    assert (chat.sampling.n, chat.sampling.stop, chat.top_logprobs, chat.stream, chat.include_usage) == \
        (4, ("\n",), 5, True, True)
    assert (chat.tool_choice.mode, chat.tool_choice.name, chat.use_tools) == ("function", "bash", True)
    completion = parse_completion_request({"prompt": "x", "logprobs": 3, "stop": ["a", "b"], "n": 2})
    assert (completion.top_logprobs, completion.logprobs, completion.sampling.stop, completion.sampling.n) == \
        (3, True, ("a", "b"), 2)


def test_errors_on_openai_paths_name_their_field():
    from stacx.serving.openai_errors import is_openai_path, openai_error_body

    assert openai_error_body(400, "/v1/chat/completions: 'top_p' must be > 0") == {"error": {
        "message": "/v1/chat/completions: 'top_p' must be > 0", "type": "BadRequestError", "param": "top_p",
        "code": 400}}
    assert openai_error_body(503, "queue is full")["error"] | {"message": None} == {
        "message": None, "type": "ServiceUnavailableError", "param": None, "code": 503}
    assert is_openai_path("/v1/models") and is_openai_path("/sessions/e-1/v1/chat/completions")
    assert not is_openai_path("/generate") and not is_openai_path("/stacx/sessions/v1/")


def test_n_samples_are_sibling_leaves_of_the_turn_they_extend_and_a_next_turn_continues_the_one_the_agent_kept():
    from stacx.rollout.agents.agent_trajectories import assemble_trajectories

    book = SessionBook()
    root = SessionTurn(RecordedTurn(prompt_ids=(1,), output_ids=(2,), output_log_probs=(-0.1,), weight_version=0),
                       messages=[])
    book.record("s", root)
    group = [SessionTurn(RecordedTurn(prompt_ids=(1, 2, 3), output_ids=(10 + i,), output_log_probs=(-0.1,),
                                      weight_version=0), messages=[]) for i in range(3)]
    book.record("s", group, continued=root)  # one request of n=3 samples continuing the root
    assert book.leaves("s") == group[::-1]  # the samples are leaves (newest first); the root is not
    kept = SessionTurn(RecordedTurn(prompt_ids=(1, 2, 3, 11, 5), output_ids=(6,), output_log_probs=(-0.2,),
                                    weight_version=0), messages=[])
    book.record("s", kept, continued=group[1])
    assert book.leaves("s") == [kept, group[2], group[0]]  # the others may still be continued
    samples = assemble_trajectories(book.turns("s"))
    assert [s.metadata["num_turns"] for s in samples] == [2, 2, 1]
    assert [(s.metadata["branch_of"], s.metadata["branch_point"]) for s in samples] == [(None, 0), (0, 3), (0, 3)]
    assert samples[1].response_ids == [11, 5, 6] and samples[1].loss_mask == [1, 0, 1]
    small = SessionBook(max_turns_per_session=6)
    small.record("t", group)
    with pytest.raises(ValueError, match="more than 6 turns"):  # a request's samples are recorded all or none
        small.record("t", group + group[:1])
    assert len(small.turns("t")) == 3
