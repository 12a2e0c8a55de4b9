"""An agent program for `stacx train --agent-command`, written with the official `anthropic` client.

    stacx train --algorithm grpo --agent-command "python examples/anthropic_agent/agent.py" ...

Stacx starts this program once per episode. The client needs no arguments: `anthropic.Anthropic()`
reads ANTHROPIC_BASE_URL (the episode's session on the run's engine) and ANTHROPIC_API_KEY from the
environment `--agent-command` sets, and the task (the prompt row: "prompt", "label", "metadata") is
in STACX_TASK as JSON. Every reply the engine writes is recorded by the server and trained on with
the engine's own token ids (docs/openai-endpoint.md); the program says how the episode went by
writing `{"reward": x}` to the file STACX_REWARD_FILE names (a private file: its standard output is never
read as a reward, since the model's own text could end with such a line).

The task is the agent demo's (stacx.tasks.tool_addition, `stacx demo --agent`): "what is 12+34? use
add". The model may call the `add` tool (its `tool_use` blocks are answered with `tool_result`
blocks) and then answers; reward 1.0 when it called `add` with the task's numbers and answered
their sum alone, else 0.0.
"""

import json
import os

import anthropic

MAX_TURNS = 3
ADD_TOOL = {"name": "add", "description": "Add two integers.",
            "input_schema": {"type": "object", "required": ["a", "b"],
                             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


def run_add(arguments: dict) -> str:
    try:
        return str(int(arguments["a"]) + int(arguments["b"]))
    except (KeyError, TypeError, ValueError) as error:
        return f"error: add takes two integers a and b ({error!r})"


def play(client: anthropic.Anthropic, task: dict) -> float:
    numbers = (task["metadata"]["a"], task["metadata"]["b"])
    messages = [{"role": "user", "content": task["prompt"]}]
    called_with_task_numbers = False
    for _ in range(MAX_TURNS):
        reply = client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[ADD_TOOL])
        if reply.stop_reason != "tool_use":
            answer = "".join(block.text for block in reply.content if block.type == "text")
            return 1.0 if called_with_task_numbers and answer.strip() == str(sum(numbers)) else 0.0
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
        results = []
        for call in (block for block in reply.content if block.type == "tool_use"):
            if call.name == "add" and tuple(call.input.get(k) for k in ("a", "b")) in (numbers, numbers[::-1]):
                called_with_task_numbers = True
            content = run_add(call.input) if call.name == "add" else f"error: no tool named {call.name!r}"
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": content})
        messages.append({"role": "user", "content": results})
    return 0.0  # no answer within MAX_TURNS replies


if __name__ == "__main__":
    task = json.loads(os.environ["STACX_TASK"])
    reward = play(anthropic.Anthropic(max_retries=0), task)
    # The reward goes to the private file Stacx names, never to stdout (which the model's text could fill).
    with open(os.environ["STACX_REWARD_FILE"], "w") as handle:
        json.dump({"reward": reward}, handle)
