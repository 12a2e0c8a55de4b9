"""One bring-your-own-scaffold episode with vLLM generating: `stacx serve`'s OpenAI endpoint and session
recorder in front of the session's vLLM server (EngineHttpServer over a VllmEngine client), an agent
that talks to its base URL with the openai client, and the recorded turns token-exact: the ids Stacx
tokenized and vLLM generated, each with vLLM's log-prob."""

from __future__ import annotations

import pytest

from stacx.serving.server import EngineHttpServer
from stacx.rollout.engines.vllm import VllmEngine
from stacx.rollout.service import load_tokenizer

pytestmark = pytest.mark.vllm


def test_an_agent_episode_through_the_session_recorder_in_front_of_vllm(vllm_server, vllm_checkpoints):
    import openai

    from stacx.rollout.agents.agent_rollout import AgentRollout

    url, _ = vllm_server
    engine = VllmEngine(url)
    tokenizer = load_tokenizer(vllm_checkpoints[0])

    def agent(base_url: str, task: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": task["prompt"]}]
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "12"}]
        client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        return 1.0

    with EngineHttpServer(engine, tokenizer=tokenizer, model_path=vllm_checkpoints[0]) as front:
        rollout = AgentRollout(agent, server_url=front.url, api_key=front.api_key,
                               next_tasks=lambda step: [{"prompt": "321"}], n_samples_per_task=1)
        samples, metrics = rollout.collect(0)
    engine.shutdown()
    assert metrics["rollout/agent_turns_mean"] == 2.0 and metrics["rollout/agent_failed_episodes"] == 0.0
    (sample,) = samples
    generated = [i for i, m in enumerate(sample.loss_mask) if m]
    assert generated and len(sample.rollout_log_probs) == len(sample.loss_mask)
    assert all(sample.rollout_log_probs[i] < 0.0 for i in generated)
    assert sample.reward == 1.0
