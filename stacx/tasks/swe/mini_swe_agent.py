"""mini-swe-agent, unmodified, as the `--agent-command` of an SWE run: every command in a sandbox.

    stacx train --algorithm grpo --hf-checkpoint CKPT --prompt-data swe_tasks.jsonl \\
        --agent-command "python -m stacx.tasks.swe.mini_swe_agent" ...

One episode per call. The task is the prompt row Stacx passes in STACX_TASK (a row of `stacx tasks swe`:
`swe_task` or `swe_builtin`, and `sandbox`, in its metadata). The program opens one sandbox session on the
task's repository (stacx.sandbox.agent_environment.SandboxEnvironment), runs mini-swe-agent's
`DefaultAgent` with its `LitellmModel` against OPENAI_BASE_URL (the episode's recorded session), judges the
agent's edits once it submits (`evaluate_session`: the edits of that session, the task's tests in a fresh
copy, as the `swe` environment's submit does), writes the reward to STACX_REWARD_FILE, and closes the session. An episode that ends without a submit earns 0.0.

The agent's prompts and limits are a mini-swe-agent config (`--config`, repeatable, merged as mini's
`-c` merges them: a YAML file, one of mini-swe-agent's built-in names such as `swebench.yaml`, or
`key=value`); only its `agent` and `model` sections and `environment.timeout` are read: the environment is
always the sandbox. Without one, a compact config (COMPACT_CONFIG) that fits small contexts. `step_limit`
defaults to the row's `max_turns`. `--trajectory-dir DIR` keeps mini-swe-agent's trajectory of each
episode (every command and its output) in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import Optional, Sequence

from stacx.sandbox import SandboxConfig
from stacx.sandbox.agent_environment import SandboxEnvironment
from stacx.tasks.swe.evaluate import evaluate_session, snapshot_source
from stacx.tasks.swe.reward import sandbox_for, task_of

COMPACT_CONFIG = {
    "agent": {
        "system_template": "You fix bugs in a Python repository. Call the bash tool to run commands in its root. "
                           "When the fix is made, run `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` alone.",
        "instance_template": "{{task}}",
        "cost_limit": 0,
    },
    "model": {
        "observation_template": "{{output.returncode}}\n{{output.output[-2000:]}}",
        "format_error_template": "{{error}}",
    },
}
"""The prompts used without --config: short, so that a small model's context holds the turns."""

MODEL_NAME = "openai/policy"
"""litellm's name of the served policy (the OpenAI provider, at OPENAI_BASE_URL)."""


def merged_config(specs: Sequence[str]) -> dict:
    """mini-swe-agent's config from `--config` specs (none: COMPACT_CONFIG), merged as its `mini -c` does."""
    if not specs:
        return json.loads(json.dumps(COMPACT_CONFIG))
    from minisweagent.config import get_config_from_spec
    from minisweagent.utils.serialize import recursive_merge

    return recursive_merge(*[get_config_from_spec(spec) for spec in specs])


def run_episode(row: dict, *, base_url: str, api_key: str, config: dict,
                trajectory_dir: Optional[str] = None) -> dict:
    """One episode of mini-swe-agent on the task of `row` (a prompt row) -> {"reward", "exit_status", ...}."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_model import LitellmModel

    metadata = row.get("metadata") or {}
    task = task_of(metadata)
    setting = metadata.get("sandbox") or {}
    agent_config = dict(config.get("agent") or {})
    agent_config.pop("agent_class", None)
    agent_config.setdefault("step_limit", int(metadata.get("max_turns", 20)))
    if trajectory_dir:
        agent_config["output_path"] = os.path.join(trajectory_dir, f"{task.instance_id}-{uuid.uuid4().hex[:8]}.json")
    model_config = dict(config.get("model") or {})
    model_config.pop("model_class", None)
    model_config["model_name"] = MODEL_NAME
    model_config.setdefault("cost_tracking", "ignore_errors")
    model_config["model_kwargs"] = {**(model_config.get("model_kwargs") or {}), "api_base": base_url,
                                    "api_key": api_key}
    timeout = (config.get("environment") or {}).get("timeout", SandboxConfig.from_dict(setting).limits.wall_time_s)
    sandbox = sandbox_for(setting)
    env = SandboxEnvironment(session=sandbox.create(snapshot_source(task)), sandbox=SandboxConfig.from_dict(setting),
                             timeout=timeout)
    try:
        agent = DefaultAgent(LitellmModel(**model_config), env, **agent_config)
        exit_status = agent.run(task.problem_statement).get("exit_status", "")
        if exit_status != "Submitted":
            return {"reward": 0.0, "exit_status": exit_status, "instance_id": task.instance_id}
        evaluation = evaluate_session(task, env.session, sandbox)
        return {"reward": evaluation.reward, "exit_status": exit_status, "instance_id": task.instance_id,
                "resolved": evaluation.resolved, "error": evaluation.error}
    finally:
        env.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacx.tasks.swe.mini_swe_agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], metavar="SPEC",
                        help="mini-swe-agent config: a YAML file, a built-in name (swebench.yaml) or key=value; "
                             "repeatable, merged in order (default: the compact config)")
    parser.add_argument("--trajectory-dir", default=None, help="keep each episode's mini-swe-agent trajectory here")
    args = parser.parse_args(argv)
    missing = [name for name in ("STACX_TASK", "OPENAI_BASE_URL", "STACX_REWARD_FILE") if not os.environ.get(name)]
    if missing:
        parser.error(f"{', '.join(missing)} not set: Stacx runs this program with --agent-command, which sets them")
    # mini-swe-agent and litellm, offline and quiet: no banner, no download of litellm's price list.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    if args.trajectory_dir:
        os.makedirs(args.trajectory_dir, exist_ok=True)
    result = run_episode(json.loads(os.environ["STACX_TASK"]), base_url=os.environ["OPENAI_BASE_URL"],
                         api_key=os.environ.get("OPENAI_API_KEY") or "stacx-episode",
                         config=merged_config(args.config), trajectory_dir=args.trajectory_dir)
    with open(os.environ["STACX_REWARD_FILE"], "w") as handle:
        json.dump({"reward": result["reward"]}, handle)
    print(json.dumps(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
