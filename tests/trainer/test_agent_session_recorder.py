"""An agent run on an engine that records no sessions (vLLM) records them with `stacx serve`'s recorder in front of
the driver's engine client (stacx.trainer.session_recorder): the preflight lets `--agent` runs use such a kind, a
tool-calling episode through the front is recorded token-exact (the engine's ids and log-probs, the template's ids
between turns), and closing the rollout service stops the front. In process, over a scripted engine; the same path
against a live vLLM server is tests/vllm/test_vllm_training.py's torchrun launch."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import requests

from stacx.rollout.agents.agent_rollout import AgentRollout
from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.service import RolloutService
from stacx.trainer.config.checks import check_agent_supported
from stacx.trainer.config.run import RunConfig
from stacx.trainer.preflight import PreflightError
from stacx.trainer.recipes import get_recipe
from stacx.launch.session_front import engine_http_server
from stacx.trainer.session_recorder import session_endpoint
from tests.rollout.agents.agent_fixtures import ScriptedEngine

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "evaluate an expression",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}
LOG_PROB = -0.25


class ScriptedIdsEngine(ScriptedEngine):
    """The shared scripted engine at weight version 3 (its outputs carry it), each id with LOG_PROB (an engine
    client that takes and returns ids, as VllmEngine does)."""

    def __init__(self, turns: list[list[int]]):
        super().__init__(turns, log_prob=LOG_PROB)

    def generate(self, requests):
        return [dataclasses.replace(output, weight_version=3) for output in super().generate(requests)]

    def weight_version(self):
        return 3


def _chars(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(ch) for ch in text]


def test_an_agent_run_may_use_vllm_and_still_not_sglang():
    agent = {"agent_command": f"{sys.executable} agent.py"}
    assert resolve_engine_kind("vllm").serves_agents and not resolve_engine_kind("vllm").records_sessions
    check_agent_supported(RunConfig.from_dict({"rollout_engine": "vllm", **agent}), get_recipe("grpo"))
    with pytest.raises(PreflightError, match=r"records the agent's sessions.*sessions_through_recorder=True.*'sglang'"):
        check_agent_supported(RunConfig.from_dict({"rollout_engine": "sglang", **agent}), get_recipe("grpo"))
    with pytest.raises(ValueError, match=r"'sglang' records no agent sessions"):
        session_endpoint(resolve_engine_kind("sglang"), None, model_path="")


def test_a_kind_that_records_sessions_is_its_own_endpoint():
    service = RolloutService(ScriptedIdsEngine([]), engine_kind="cpu", url="http://127.0.0.1:9", tokenizer=None,
                             rollout_section=None, api_key="engine-secret")
    endpoint = session_endpoint(resolve_engine_kind("cpu"), service, model_path="")
    assert (endpoint.url, endpoint.api_key) == ("http://127.0.0.1:9", "engine-secret")


def test_a_tool_calling_episode_is_recorded_token_exact_by_the_recorder_in_front_of_the_engine():
    import openai

    tokenizer = build_tool_chat_tokenizer("qwen")
    call = '{"name": "calculator", "arguments": {"expression": "3*4"}}'
    turns = [[tokenizer.convert_tokens_to_ids("<tool_call>")] + _chars(tokenizer, "\n" + call + "\n")
             + [tokenizer.convert_tokens_to_ids("</tool_call>"), tokenizer.eos_token_id],
             _chars(tokenizer, "the answer is 12") + [tokenizer.eos_token_id]]
    engine = ScriptedIdsEngine(turns)
    service = RolloutService(engine, engine_kind="vllm", url="http://127.0.0.1:9", tokenizer=tokenizer,
                             rollout_section=None)
    endpoint = session_endpoint(resolve_engine_kind("vllm"), service, model_path="", front_factory=engine_http_server)
    assert endpoint.url != service.url and endpoint.api_key
    seen_calls = []

    def agent(base_url: str, task: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": task["prompt"]}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=64)
        message = first.choices[0].message
        seen_calls.extend((c.function.name, c.function.arguments) for c in message.tool_calls or [])
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "12"}]
        second = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=64)
        return float(second.choices[0].message.content == "the answer is 12")

    try:
        rollout = AgentRollout(agent, server_url=endpoint.url, api_key=endpoint.api_key,
                               next_tasks=lambda step: [{"prompt": "3*4"}], n_samples_per_task=1)
        samples, metrics = rollout.collect(0)
    finally:
        service.close()
    assert seen_calls == [("calculator", '{"expression": "3*4"}')]
    assert metrics["rollout/agent_turns_mean"] == 2.0 and metrics["rollout/agent_failed_episodes"] == 0.0
    (sample,) = samples
    assert sample.reward == 1.0 and sample.weight_version == 3
    # the second request continues the first's ids with the engine's own ids, then the template's tool turn
    assert engine.inputs[1][:len(engine.inputs[0]) + len(turns[0])] == engine.inputs[0] + turns[0]
    tokens = sample.prompt_ids + sample.response_ids
    assert tokens == engine.inputs[1] + turns[1]
    generated = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert generated == turns[0] + turns[1]
    assert all(lp == (LOG_PROB if m else 0.0) for lp, m in zip(sample.rollout_log_probs, sample.loss_mask))
    with pytest.raises(requests.ConnectionError):  # the front stopped with the service
        requests.get(endpoint.url + "/health", timeout=5)


def test_episodes_of_an_engine_that_records_no_sessions_all_go_through_the_recorder_in_front():
    """A supervised pool moves each episode to a live engine only when the engines record sessions themselves; a
    vLLM episode sent to the engine's own URL would open its session where no session route exists (404)."""
    from types import SimpleNamespace

    from stacx.rollout.agents.episode_engines import EpisodeEngines
    from stacx.rollout.engine_pool import EnginePool
    from stacx.trainer.sample_sources import episode_engines

    from stacx.rollout.sections import RolloutSection

    pool = EnginePool([ScriptedIdsEngine([[1]])], names=["http://engine"])
    pool.supervise(settings=RolloutSection(engine_health_interval_s=0.05, attached_engine_wait_s=0.0))
    try:
        supervised = SimpleNamespace(supervisor=pool.supervisor, engine=pool)
        assert episode_engines(resolve_engine_kind("vllm"), supervised) is None
        assert isinstance(episode_engines(resolve_engine_kind("cpu"), supervised), EpisodeEngines)
        assert episode_engines(resolve_engine_kind("cpu"), SimpleNamespace(supervisor=None, engine=pool)) is None
    finally:
        pool.shutdown()
