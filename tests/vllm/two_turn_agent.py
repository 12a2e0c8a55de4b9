"""The `--agent` of the vLLM tier's torchrun launch: two chat turns through the run's session endpoint (the
recorder in front of vLLM), the second after an observation the agent writes, as a tool's answer would be."""

from __future__ import annotations


def two_turns(base_url: str, task: dict) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "12"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
