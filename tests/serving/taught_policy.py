"""The taught tool-calling policy the endpoint tests serve (OpenAI's and Anthropic's routes): a tiny model
taught, by a few SFT steps in-process, one demonstration transcript (the task, a `touch done.txt` bash call,
its observation, the submit call), rendered by the chat template the server uses. Served greedily it makes
both calls.

Teaching it is the expensive part of those files (about 15 s of CPU), so one pytest run teaches it once:
`tests/serving/fixtures.py`'s session-scoped `taught_policy` fixture builds it under a file lock in the run's
shared temporary folder, and every pytest worker and test module serves that one checkpoint."""

from __future__ import annotations

import os

import torch

from tests.rollout.agents.agent_fixtures import save_policy, tool_tokenizer

SYSTEM = "You run bash."
TASK = "Create done.txt"
OBSERVATION = "{{output.returncode}}{{output.output}}"
"""mini-swe-agent's observation template for this test: the return code, then the output."""
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
BASH = {"type": "function", "function": {"name": "bash"}}
"""What the template reads of mini-swe-agent's bash tool (its name)."""


def demonstration() -> list[dict]:
    def call(command, index):
        arguments = {"command": command}
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call{index}", "type": "function", "function": {"name": "bash", "arguments": arguments}}]}

    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}, call("touch done.txt", 0),
            {"role": "tool", "tool_call_id": "call0", "content": "0"}, call(SUBMIT, 1)]


def teach(path: str, tokenizer, *, max_steps: int = 300) -> int:
    """SFT on the assistant turns of the demonstration until greedy decoding reproduces them; returns the steps."""
    from transformers import AutoModelForCausalLM

    messages = demonstration()

    def length(upto, generation_prompt):
        text = tokenizer.apply_chat_template(messages[:upto], tools=[BASH], tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = torch.tensor(tokenizer(tokenizer.apply_chat_template(messages, tools=[BASH], tokenize=False),
                                 add_special_tokens=False)["input_ids"])
    mask = torch.zeros(len(ids))
    for turn in (2, 4):
        mask[length(turn, True):length(turn + 1, False)] = 1.0
    mask = mask[1:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one sequence of 250 tokens: threads only contend
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(max_steps):
            logits = model(input_ids=ids[None]).logits[0, :-1]
            log_probs = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
            loss = -(log_probs * mask).sum() / mask.sum()
            if bool(((logits.argmax(-1) == ids[1:]) | (mask == 0)).all()) and float(loss) < 0.05:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            raise AssertionError(f"the demonstration was not learned in {max_steps} steps (loss {float(loss):.3f})")
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(path, safe_serialization=True)
    return step


def taught_checkpoint(folder) -> str:
    """The taught policy's checkpoint in `folder` (a folder every pytest worker of the run sees): taught by the
    first caller, under a file lock; a later caller, in this process or another, finds it there."""
    from filelock import FileLock

    path = os.path.join(folder, "taught_policy")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "TAUGHT")):
            tokenizer = tool_tokenizer()
            partial = path + ".partial"
            save_policy(partial, tokenizer)
            teach(partial, tokenizer)
            with open(os.path.join(partial, "TAUGHT"), "w") as marker:
                marker.write("taught\n")
            os.replace(partial, path)
    return path
