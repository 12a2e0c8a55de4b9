"""`stacx serve`'s OpenAI-compatible endpoint, through the official `openai` client: chat with tools,
completions, sessions recorded token-in/token-out, and a GRPO step trained on an agent's sessions; then
mini-swe-agent, unmodified, solving a task through the endpoint, its trajectory trained on.

The served tiny policy learns that task first (`tests/serving/taught_policy.py`, taught once per pytest
run and shared with the Anthropic route's tests): a few SFT steps in-process on one demonstration
transcript (the task, a `touch done.txt` tool call, its observation, the submit call), rendered by the
chat template the server uses. Served greedily, it drives mini-swe-agent's own loop (litellm client,
bash tool calls run by Stacx's SandboxEnvironment): the file is really created, in the episode's
sandbox session, and the agent really submits.
The other tests only need a served model, and share this one.
"""

import json
import os
import sys

import pytest
import requests

from tests.deferred_import import deferred_import
from tests.rollout.agents.agent_fixtures import BASH_TOOL, engine_weight_buckets, train_one_grpo_step
from tests.serving.taught_policy import BASH, OBSERVATION, SUBMIT, SYSTEM, TASK

openai = deferred_import("openai", "these tests drive the endpoint with the official openai client")


@pytest.fixture(scope="module")
def policy(taught_policy):
    return taught_policy


@pytest.fixture(scope="module")
def server(taught_server):
    return taught_server


def client_for(server, session_id=None):
    base_url = f"{server.url}/sessions/{session_id}/v1" if session_id else f"{server.url}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def recorded(server, session_id):
    from stacx.wire.trajectories import RecordedTurn

    answer = requests.get(f"{server.url}/stacx/sessions/{session_id}", timeout=30)
    answer.raise_for_status()
    return [RecordedTurn.from_json(t) for t in answer.json()["turns"]]


@pytest.mark.slow
def test_chat_with_tools_continues_the_engines_own_ids_across_turns(server, policy):
    from stacx.rollout.agents.agent_trajectories import assemble_trajectories

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
    assert client_for(server).models.list().data[0].owned_by == "stacx"
    paths = requests.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/completions", "/sessions/{session_id}/v1/chat/completions", "/stacx/sessions/{session_id}"} <= set(paths)


@pytest.mark.parametrize("field, value, named", [
    ("frobnicate", 1, "unsupported fields ['frobnicate']"),
    ("logit_bias", {"5": 1}, "'logit_bias' is not supported"),
    ("messages", [{"role": "wizard", "content": "x"}], "'messages[0].role' must be one of"),
])
def test_unsupported_requests_get_a_400_naming_the_field(server, field, value, named):
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], field: value}
    answer = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and named in answer.json()["error"]["message"]
    bad_session = requests.post(f"{server.url}/sessions/a%20b/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert bad_session.status_code == 400 and "session id" in bad_session.json()["error"]["message"]


def test_errors_are_in_openais_schema_so_the_official_client_shows_the_message(server):
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                       stop=["a", "b", "c", "d", "e"])
    assert "'stop' may hold at most 4 strings, got 5" in str(refused.value)
    assert (refused.value.param, refused.value.code, refused.value.type) == ("stop", "400", "BadRequestError")
    with pytest.raises(openai.BadRequestError, match="'tool_choice' names the function 'ls', which is not in 'tools'"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], tools=[BASH_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "ls"}})
    with pytest.raises(openai.NotFoundError, match="unknown endpoint POST /v1/embeddings"):
        client.embeddings.create(model="policy", input="hi")
    # Stacx's own endpoints keep their {"error": "text"} answers.
    assert isinstance(requests.post(f"{server.url}/generate", json={"input_ids": []}, timeout=30).json()["error"], str)


TASK_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
"""The taught task: served greedily with the bash tool, the policy answers with the `touch done.txt` call."""


def streamed(chunks):
    """A streamed chat answer joined as a client joins it: per choice its content, tool calls, finish reason."""
    choices, usage = {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for part in chunk.choices:
            choice = choices.setdefault(part.index, {"content": "", "calls": {}, "logprobs": [], "finish": None,
                                                     "stacx": None})
            choice["content"] += part.delta.content or ""
            choice["logprobs"] += part.logprobs.content if part.logprobs else []
            for call in part.delta.tool_calls or ():
                joined = choice["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                joined["id"] = call.id or joined["id"]
                joined["name"] += call.function.name or "" if call.function else ""
                joined["arguments"] += call.function.arguments or "" if call.function else ""
            choice["finish"] = part.finish_reason or choice["finish"]
            choice["stacx"] = (part.model_extra or {}).get("stacx") or choice["stacx"]
    return choices, usage


def test_streamed_chat_with_tools_is_the_answer_a_plain_call_gets_and_records_the_same_ids(server):
    plain = client_for(server, "plain-1").chat.completions.create(
        model="policy", messages=TASK_MESSAGES, tools=[BASH], temperature=0, max_tokens=120)
    choices, usage = streamed(client_for(server, "stream-1").chat.completions.create(
        model="policy", messages=TASK_MESSAGES, tools=[BASH], temperature=0, max_tokens=120, stream=True,
        stream_options={"include_usage": True}))
    (choice,) = choices.values()
    (call,) = plain.choices[0].message.tool_calls
    assert choice["finish"] == "tool_calls" == plain.choices[0].finish_reason
    assert list(choice["calls"].values()) == [{"id": call.id, "name": "bash", "arguments": call.function.arguments}]
    assert json.loads(call.function.arguments) == {"command": "touch done.txt"}
    assert usage.completion_tokens == plain.usage.completion_tokens and usage.prompt_tokens == plain.usage.prompt_tokens
    assert recorded(server, "stream-1") == recorded(server, "plain-1")
    assert choice["stacx"]["output_token_ids"] == list(recorded(server, "stream-1")[0].output_ids)


def test_streamed_text_comes_one_chunk_per_token_with_its_log_probs(server):
    messages = [{"role": "user", "content": "hi"}]
    plain = client_for(server).chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=11,
                                                       logprobs=True, top_logprobs=2)
    chunks = list(client_for(server).chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=11,
                                                             logprobs=True, top_logprobs=2, stream=True))
    (choice,) = streamed(chunks)[0].values()
    assert choice["content"] == plain.choices[0].message.content
    assert choice["logprobs"] == plain.choices[0].logprobs.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs) == plain.usage.completion_tokens
    text = client_for(server).completions.create(model="policy", prompt="count: 1 2", max_tokens=5, seed=7, logprobs=1,
                                                 stream=True)
    pieces = [c.choices[0] for c in text]
    plain_text = client_for(server).completions.create(model="policy", prompt="count: 1 2", max_tokens=5, seed=7,
                                                       logprobs=1)
    assert "".join(p.text for p in pieces) == plain_text.choices[0].text and pieces[-1].finish_reason is not None
    assert [lp for p in pieces if p.logprobs for lp in p.logprobs.token_logprobs] == \
        plain_text.choices[0].logprobs.token_logprobs


def test_n_samples_are_one_request_each_its_own_trajectory_and_the_kept_sample_continues(server):
    from stacx.rollout.agents.agent_trajectories import assemble_trajectories

    client = client_for(server, "group-1")
    messages = [{"role": "user", "content": "hi"}]
    group = client.chat.completions.create(model="policy", messages=messages, n=4, max_tokens=8, seed=5)
    assert [c.index for c in group.choices] == [0, 1, 2, 3]
    turns = recorded(server, "group-1")
    assert [list(t.output_ids) for t in turns] == [c.model_extra["stacx"]["output_token_ids"] for c in group.choices]
    assert len({t.prompt_ids for t in turns}) == 1 and len({t.output_ids for t in turns}) > 1   # one prompt, n samples
    assert group.usage.completion_tokens == sum(len(t.output_ids) for t in turns)
    alone = client_for(server).chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=5 + 3)
    assert alone.model_extra["stacx"]["output_token_ids"] == list(turns[3].output_ids)  # sample i is seeded seed + i
    kept = group.choices[2].message
    client.chat.completions.create(model="policy", messages=messages + [kept.model_dump(exclude_none=True),
                                                                        {"role": "user", "content": "more"}],
                                   max_tokens=4, seed=6)
    turns = recorded(server, "group-1")
    head = turns[2].prompt_ids + turns[2].output_ids
    assert turns[4].prompt_ids[:len(head)] == head  # continues the kept sample's own ids
    samples = assemble_trajectories(turns)
    assert [s.metadata["num_turns"] for s in samples] == [1, 1, 2, 1]
    assert [s.metadata["branch_of"] for s in samples] == [None, 0, 0, 0]  # siblings in the session's tree
    first = group.choices[0].message  # another sample is still a leaf after one was continued
    client.chat.completions.create(model="policy", messages=messages + [first.model_dump(exclude_none=True),
                                                                        {"role": "user", "content": "again"}],
                                   max_tokens=4, seed=7)
    turns = recorded(server, "group-1")
    head = turns[0].prompt_ids + turns[0].output_ids
    assert turns[5].prompt_ids[:len(head)] == head
    assert [s.metadata["num_turns"] for s in assemble_trajectories(turns)] == [2, 1, 2, 1]


def test_stop_strings_cut_the_text_and_the_recorded_ids_end_with_the_stop(server):
    stop = '"arguments"'
    common = dict(model="policy", messages=TASK_MESSAGES, tools=[BASH], tool_choice="none", temperature=0,
                  max_tokens=48)  # the taught call writes "arguments" by its 39th token
    whole = client_for(server, "whole-1").chat.completions.create(**common)
    cut = client_for(server, "stop-1").chat.completions.create(**common, stop=["never", stop], logprobs=True)
    text = whole.choices[0].message.content
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert (cut.choices[0].finish_reason, cut.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    (turn,) = recorded(server, "stop-1")
    (whole_turn,) = recorded(server, "whole-1")
    # The ids up to and including the ones that wrote the stop string: the engine's, with their log-probs.
    assert server.tokenizer.decode(list(turn.output_ids)) == text[:text.index(stop) + len(stop)]
    assert turn.output_ids == whole_turn.output_ids[:len(turn.output_ids)]
    assert [e.logprob for e in cut.choices[0].logprobs.content] == pytest.approx(turn.output_log_probs)
    assert cut.usage.completion_tokens == len(turn.output_ids)


def test_top_logprobs_are_the_engines_top_k(server, policy):
    from stacx.wire.types import GenerateRequest, SamplingParams

    _, tokenizer = policy
    messages = [{"role": "user", "content": "hi"}]
    answer = client_for(server).chat.completions.create(model="policy", messages=messages, max_tokens=4,
                                                        temperature=0, logprobs=True, top_logprobs=5)
    prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    greedy = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    (engine,) = server.engine.generate([GenerateRequest(input_ids=tuple(prompt), top_logprobs_num=5, sampling=greedy)])
    entries = answer.choices[0].logprobs.content
    assert len(entries) == len(engine.output_ids)
    for entry, token, top in zip(entries, engine.output_ids, engine.output_top_log_probs):
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for _, i in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for lp, _ in top], abs=1e-5)
        assert entry.token == tokenizer.decode([token]) == entry.top_logprobs[0].token  # greedy: the most likely
    text = client_for(server).completions.create(model="policy", prompt="count: 1 2", max_tokens=3, temperature=0,
                                                 logprobs=3)
    tops = text.choices[0].logprobs.top_logprobs
    assert len(tops) == 3 and all(len(top) == 3 for top in tops)  # greedy: the sampled token is among the 3


def test_tool_choice_required_or_named_opens_the_call_in_the_prompt_and_the_model_writes_the_rest(server, policy):
    _, tokenizer = policy
    template = tokenizer.apply_chat_template(TASK_MESSAGES, tools=[BASH], tokenize=True, add_generation_prompt=True,
                                             return_dict=False)
    openings = {"required": "<tool_call>", "bash": '<tool_call>{"name": "bash", "arguments": '}
    for name, choice in (("required", "required"), ("bash", {"type": "function", "function": {"name": "bash"}})):
        answer = client_for(server, f"forced-{name}").chat.completions.create(
            model="policy", messages=TASK_MESSAGES, tools=[BASH], tool_choice=choice, temperature=0, max_tokens=120)
        (call,) = answer.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "touch done.txt"})
        assert answer.choices[0].finish_reason == "tool_calls"
        (turn,) = recorded(server, f"forced-{name}")
        # The opening is prompt (masked 0, never trained on); every sampled id is output, with its log-prob.
        assert turn.prompt_ids[:len(template)] == tuple(template)
        assert tokenizer.decode(list(turn.prompt_ids[len(template):])) == openings[name]
        assert openings[name] + tokenizer.decode(list(turn.output_ids)) == \
            '<tool_call>{"name": "bash", "arguments": {"command": "touch done.txt"}}</tool_call><eos>'
    cut = client_for(server).chat.completions.create(model="policy", messages=TASK_MESSAGES, tools=[BASH],
                                                     tool_choice="required", temperature=0, max_tokens=3)
    assert cut.choices[0].message.tool_calls is None and cut.choices[0].finish_reason == "length"
    assert cut.choices[0].model_extra["stacx"]["tool_call_errors"]   # validated: no call is made up


def test_a_grpo_step_trains_on_an_agents_sessions_with_the_engines_ids(server, tmp_path):
    """AgentRollout runs a two-turn agent (the openai client) per task; the real loop trains one GRPO step on
    the assembled sessions, and its recomputed log-probs of the generated ids equal the engine's."""
    from stacx.rollout.agents.agent_rollout import AgentRollout

    def agent(base_url: str, task: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, logprobs=True)
        return -sum(entry.logprob for entry in second.choices[0].logprobs.content)  # varies with every sample

    tasks = [{"question": "1+1?"}, {"question": "2*3?"}]
    rollout = AgentRollout(agent, server_url=server.url, api_key=server.api_key, next_tasks=lambda step: tasks,
                           n_samples_per_task=2,
                           max_parallel_episodes=4)
    batch, metrics, runtime = train_one_grpo_step(server, rollout, tmp_path, num_tasks=2, n_samples_per_task=2)
    assert batch.num_samples == 4 and batch.prompt_id == [0, 0, 1, 1]
    assert len(set(batch.rewards[:2])) > 1 or len(set(batch.rewards[2:])) > 1, "every group uniform: nothing to learn"
    assert metrics["test/weights_changed"] == 1.0 and metrics["rollout/agent_turns_mean"] == 2.0

    # The trained weights reach the engine as version 1 (what the loop's weight push does): the next turn
    # is recorded under that policy version. The engine gets its own weights back afterwards (version 2).
    engine = server.engine
    served = engine_weight_buckets(engine.model, engine.groups)
    engine.update_weights(engine_weight_buckets(runtime.model, runtime.groups), version=engine.weight_version() + 1)
    try:
        answer = client_for(server, "after-step").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "1+1?"}], max_tokens=3)
        (turn,) = recorded(server, "after-step")
        assert turn.weight_version == engine.weight_version() >= 1
        assert answer.system_fingerprint == f"weights-v{turn.weight_version}"
    finally:
        engine.update_weights(served, version=engine.weight_version() + 1)


DONE_TASK = {"instance_id": "done_file", "problem_statement": TASK, "test_command": "python3 -m unittest -v",
             "snapshot": {"tests/__init__.py": "", "tests/test_done.py": (
                 "import os\nimport unittest\n\n\nclass DoneTest(unittest.TestCase):\n    def test_done(self):\n"
                 "        self.assertIs(os.path.isfile('done.txt'), True)\n")},
             "FAIL_TO_PASS": ["tests.test_done.DoneTest.test_done"]}
"""The taught task as an SWE task row: its test passes once done.txt exists."""


def mini_swe_agent(workdirs):
    """mini-swe-agent's DefaultAgent and LitellmModel as shipped, configured for the task, its commands run by
    Stacx's SandboxEnvironment: each episode works in a fresh sandbox session on a copy of a new folder under
    `workdirs`. Returns the agent and the list it appends (folder, whether done.txt exists in the session) to."""
    import tempfile
    from pathlib import Path

    from stacx.sandbox.agent_environment import SandboxEnvironment

    try:
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.models.litellm_model import LitellmModel
    except ImportError as missing:  # a failure with the fix, never a skip
        raise ImportError("this test runs mini-swe-agent, in the test extra: pip install -e '.[test]'") from missing

    made = []

    def agent(base_url: str, task: dict) -> float:
        workdir = Path(tempfile.mkdtemp(dir=workdirs))
        model = LitellmModel(model_name="openai/policy", cost_tracking="ignore_errors",
                             observation_template=OBSERVATION, format_error_template="{{error}}",
                             model_kwargs={"api_base": base_url, "api_key": "unused", "temperature": 0.0,
                                           "max_tokens": 120})
        with SandboxEnvironment(source=str(workdir), sandbox={"backend": "namespace"}, timeout=30) as env:
            runner = DefaultAgent(model, env, system_template=SYSTEM, instance_template="{{task}}", step_limit=4,
                                  cost_limit=0)
            result = runner.run(task["task"])
            done = env.execute({"command": "test -f done.txt"})["returncode"] == 0
        made.append((workdir, done))
        return float(result.get("exit_status") == "Submitted" and done)

    return agent, made


@pytest.mark.slow  # litellm's import alone is about 3 s of CPU
def test_mini_swe_agent_solves_the_task_through_the_endpoint_and_grpo_trains_on_it(server, tmp_path, monkeypatch):
    from stacx.rollout.agents.agent_rollout import AgentCommand, AgentRollout

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would download its price list
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea"))
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    agent, workdirs = mini_swe_agent(tmp_path)
    rollout = AgentRollout(agent, server_url=server.url, api_key=server.api_key, next_tasks=lambda step: [{"task": TASK}],
                           n_samples_per_task=2)
    batch, metrics, _ = train_one_grpo_step(server, rollout, tmp_path / "run", num_tasks=1, n_samples_per_task=2)

    # The file was made in each episode's sandbox session, not in the host folder it was copied from.
    assert len(workdirs) == 2 and all(done and not (workdir / "done.txt").exists() for workdir, done in workdirs)
    assert batch.rewards == [1.0, 1.0]            # each agent submitted after creating its file
    tokens, mask = batch.tokens[0].tolist(), batch.loss_masks[0]
    text = server.tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.endswith('{"command": "touch done.txt"}}</tool_call><eos><|user|>tool: 0<eos><|assistant|><tool_call>'
                         '{"name": "bash", "arguments": {"command": "' + SUBMIT + '"}}</tool_call><eos>')
    generated = server.tokenizer.decode([t for t, m in zip(tokens[-len(mask):], mask) if m], skip_special_tokens=False)
    assert "<|user|>" not in generated and generated.count("<tool_call>") == 2   # both calls, no observation
    assert metrics["rollout/agent_turns_mean"] == 2.0 and batch.tokens[1].tolist() == tokens

    # The same task as an SWE row, played by the shipped agent program, as `--agent-command "python -m
    # stacx.tasks.swe.mini_swe_agent"` runs it: mini-swe-agent in a subprocess with a scrubbed environment,
    # its commands in a sandbox session on the row's repository, the reward the task's tests give, read
    # from STACX_REWARD_FILE. Its config makes the prompts the ones the policy was taught.
    row = {"prompt": TASK, "label": "done_file", "metadata": {"swe_task": DONE_TASK, "max_turns": 4,
                                                               "sandbox": {"backend": "namespace"}}}
    trajectories = tmp_path / "trajectories"
    config = [f"agent.system_template={SYSTEM}", "agent.instance_template={{task}}",
              f"model.observation_template={OBSERVATION}", "model.format_error_template={{error}}",
              'model.model_kwargs={"temperature": 0.0, "max_tokens": 120}']
    program = AgentCommand(argv=(sys.executable, "-m", "stacx.tasks.swe.mini_swe_agent", "--trajectory-dir",
                                 str(trajectories), *[part for spec in config for part in ("--config", spec)]),
                           passed_env=tuple(name for name in ("PYTHONPATH", "MSWEA_GLOBAL_CONFIG_DIR")
                                            if name in os.environ), timeout_s=300)
    rollout = AgentRollout(program, server_url=server.url, api_key=server.api_key, next_tasks=lambda step: [row])
    (sample,), _ = rollout.collect(0)
    assert (sample.reward, sample.reward_error, sample.metadata["num_turns"]) == (1.0, None, 2)
    (trajectory,) = [json.loads(path.read_text()) for path in trajectories.iterdir()]
    assert trajectory["info"]["exit_status"] == "Submitted"
    assert trajectory["info"]["config"]["environment_type"] == "stacx.sandbox.agent_environment.SandboxEnvironment"
