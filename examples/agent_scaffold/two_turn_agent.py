"""An external agent for `stacx train --agent examples/agent_scaffold/two_turn_agent.py:run`.

Stacx calls `run(base_url, task)` once per episode; the agent talks to the run's engine through the
OpenAI-compatible `base_url` it is given, with the official client, for as many turns as it likes.
Every turn is recorded by the server and trained on with the engine's own token ids
(docs/openai-endpoint.md). Returning None lets `--reward-fn` score the last turn's answer against
the prompt row's label.
"""

import openai


def run(base_url: str, task: dict):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Check your answer and give it again."}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return None  # --reward-fn scores the last turn
