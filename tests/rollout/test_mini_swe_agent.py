"""mini-swe-agent, unmodified, solves a task through `stacx serve`'s OpenAI endpoint, and a GRPO step
trains on its trajectory with the exact ids the engine produced.

The tiny policy learns the task first: a few SFT steps in-process on one demonstration transcript
(the task, a `touch done.txt` tool call, its observation, the submit call), rendered by the same chat
template the server uses. Served greedily, it then drives mini-swe-agent's own loop (litellm client,
bash tool calls, its local environment): the file is really created and the agent really submits.
"""

import pytest
import torch

from tests.rollout.agent_fixtures import save_policy, tool_tokenizer

pytestmark = pytest.mark.slow  # litellm's import alone is about 3 s of CPU

SYSTEM = "You run bash."
TASK = "Create done.txt"
OBSERVATION = "{{output.returncode}}{{output.output}}"
"""mini-swe-agent's observation template for this test: the return code, then the output."""
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
BASH = {"type": "function", "function": {"name": "bash"}}
"""What the template reads of mini-swe-agent's bash tool (its name)."""


def demonstration() -> list[dict]:
    def call(command, index):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call{index}", "type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]}

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


@pytest.fixture(scope="module")
def server(tmp_path_factory, single_process_world):
    from stacx.rollout.engines.cpu import CpuEngine
    from stacx.rollout.engines.server import EngineHttpServer

    tokenizer = tool_tokenizer()
    path = save_policy(tmp_path_factory.mktemp("swe_policy"), tokenizer)
    teach(path, tokenizer)
    with EngineHttpServer(CpuEngine.from_hf_checkpoint(path), model_path=path, tokenizer=tokenizer) as running:
        yield running


def mini_swe_agent(workdirs):
    """mini-swe-agent's DefaultAgent, LitellmModel and LocalEnvironment as shipped, configured for the task;
    each episode works in a fresh folder under `workdirs` (appended to `made`)."""
    import tempfile
    from pathlib import Path

    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    made = []

    def agent(base_url: str, task: dict) -> float:
        workdir = Path(tempfile.mkdtemp(dir=workdirs))
        made.append(workdir)
        model = LitellmModel(model_name="openai/policy", cost_tracking="ignore_errors",
                             observation_template=OBSERVATION, format_error_template="{{error}}",
                             model_kwargs={"api_base": base_url, "api_key": "unused", "temperature": 0.0,
                                           "max_tokens": 120})
        runner = DefaultAgent(model, LocalEnvironment(cwd=str(workdir)), system_template=SYSTEM,
                              instance_template="{{task}}", step_limit=4, cost_limit=0)
        result = runner.run(task["task"])
        return float(result.get("exit_status") == "Submitted" and (workdir / "done.txt").exists())

    return agent, made


def test_mini_swe_agent_solves_the_task_through_the_endpoint_and_grpo_trains_on_it(server, tmp_path, monkeypatch):
    from stacx.rollout.agent_rollout import AgentRollout
    from tests.rollout.agent_fixtures import train_one_grpo_step

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would download its price list
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea"))
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    agent, workdirs = mini_swe_agent(tmp_path)
    rollout = AgentRollout(agent, server_url=server.url, next_tasks=lambda step: [{"task": TASK}], n_samples_per_task=2)
    batch, metrics = train_one_grpo_step(server, rollout, tmp_path / "run", num_tasks=1, n_samples_per_task=2)

    assert len(workdirs) == 2 and all((workdir / "done.txt").exists() for workdir in workdirs)
    assert batch.rewards == [1.0, 1.0]            # each agent submitted after creating its file
    tokens, mask = batch.tokens[0].tolist(), batch.loss_masks[0]
    text = server.tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.endswith('{"command": "touch done.txt"}}</tool_call><eos><|user|>tool: 0<eos><|assistant|><tool_call>'
                         '{"name": "bash", "arguments": {"command": "' + SUBMIT + '"}}</tool_call><eos>')
    generated = server.tokenizer.decode([t for t, m in zip(tokens[-len(mask):], mask) if m], skip_special_tokens=False)
    assert "<|user|>" not in generated and generated.count("<tool_call>") == 2   # both calls, no observation
    assert metrics["rollout/agent_turns_mean"] == 2.0 and batch.tokens[1].tolist() == tokens
