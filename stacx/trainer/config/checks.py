"""Checks of a run's data against its config, raised as `PreflightError` (a `ConfigError`):
labels for a reward that needs them, every sample within the model's context.

Used by the dry run (`stacx.trainer.preflight`) and by the data source when it loads rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Optional, Sequence

from stacx.rollout.agents.agent_rollout import AgentCommand, agent_from_settings
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.rewards import resolve_reward_fn, reward_needs_label
from stacx.rollout.rollin import has_environment
from stacx.rollout.sections import RolloutSection
from stacx.trainer.config.recipe import TrainingConfig
from stacx.trainer.config.run import ConfigError, RunConfig

MAX_ROWS_NAMED = 3
"""How many offending rows an error names."""


class PreflightError(ConfigError):
    """A setting would make the run fail after it started; the message names the flag and the fix."""


def model_context_length(hf_checkpoint: Optional[str]) -> Optional[int]:
    """max_position_embeddings of the checkpoint's config.json (None when absent or unreadable)."""
    if not hf_checkpoint:
        return None
    path = os.path.join(hf_checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def fit_response_length_to_context(run_config: RunConfig) -> RunConfig:
    """The default --rollout-max-response-len (64) capped at half the model's context.

    A tiny model with a 64-token context (the demo's) then gets 32, so the documented commands run as
    written; a value the user gave is kept, and `check_examples` names the rows it does not fit."""
    rollout = run_config.rollout
    if "rollout_max_response_len" in run_config.given_keys:
        return run_config
    context = model_context_length(run_config.model.hf_checkpoint)
    if context is None or rollout.rollout_max_response_len <= context // 2:
        return run_config
    fitted = dataclasses.replace(rollout, rollout_max_response_len=max(1, context // 2))
    return dataclasses.replace(run_config, rollout=fitted)


def _name_rows(sources: Sequence[str]) -> str:
    named = ", ".join(sources[:MAX_ROWS_NAMED])
    return named + (f" and {len(sources) - MAX_ROWS_NAMED} more" if len(sources) > MAX_ROWS_NAMED else "")


def check_prompts_not_empty(examples: Sequence[Any], *, data_flag: str, data_path: Any) -> None:
    """Every row has a prompt of at least one token (an empty one fails deep inside the model)."""
    empty = [e.source for e in examples if not len(e.prompt_ids)]
    if empty:
        raise PreflightError(f"{len(empty)} of {len(examples)} rows of {data_flag} {data_path} have an empty prompt: "
                             f"{_name_rows(empty)}. Give every row a prompt, or drop those rows")


def check_labels_for_reward(examples: Sequence[Any], reward_fn, *, reward_name: Any, data_flag: str, data_path: Any,
                            label_key: str) -> None:
    """Every row has a label when `reward_fn` compares the response with one (training and `stacx eval`).
    A row naming an environment is not checked: its episode's reward is the environment's."""
    unlabeled = [e.source for e in examples if not has_environment(e)
                 and (e.label is None or (isinstance(e.label, str) and not e.label.strip()))]
    if unlabeled and reward_needs_label(reward_fn):
        raise PreflightError(
            f"{len(unlabeled)} of {len(examples)} rows of {data_flag} {data_path} have no label "
            f"(key '{label_key}', --label-key), but --reward-fn {reward_name} compares the "
            f"response with it: {_name_rows(unlabeled)}. Add the labels, set --label-key to the right key, "
            "or use a reward that needs none")


def check_examples(examples: Sequence[Any], *, run_config: RunConfig, training_config: TrainingConfig,
                   kind: str) -> None:
    """Labels for a reward that needs them, and every sample within the model's context.

    prompt rows: len(prompt_ids) + rollout_max_response_len <= max_position_embeddings;
    sft / dpo rows: len(prompt_ids) + len(response) <= max_position_embeddings.
    """
    rollout = run_config.rollout
    check_prompts_not_empty(examples, data_flag="--prompt-data", data_path=rollout.prompt_data)
    if kind == "prompt" and training_config.uses_reward:
        try:
            reward_fn = resolve_reward_fn(rollout.reward_fn)
        except ValueError as err:
            raise PreflightError(f"--reward-fn: {err}") from None
        check_labels_for_reward(examples, reward_fn, reward_name=rollout.reward_fn, data_flag="--prompt-data",
                                data_path=rollout.prompt_data, label_key=rollout.label_key)
    context = model_context_length(run_config.model.hf_checkpoint)
    if context is None:
        return
    too_long = []
    for example in examples:
        if kind == "prompt":
            length = len(example.prompt_ids) + rollout.rollout_max_response_len
        elif kind == "dpo":
            length = len(example.prompt_ids) + max(len(example.chosen_ids or ()), len(example.rejected_ids or ()))
        else:
            length = len(example.prompt_ids) + len(example.response_ids or ())
        if length > context:
            too_long.append(f"{example.source} ({length} tokens)")
    if too_long:
        budget = (f"its prompt plus --rollout-max-response-len {rollout.rollout_max_response_len}"
                  if kind == "prompt" else "its prompt plus response")
        raise PreflightError(
            f"{len(too_long)} of {len(examples)} rows of --prompt-data {rollout.prompt_data} do not fit the model's "
            f"context of {context} tokens (max_position_embeddings in {run_config.model.hf_checkpoint}/config.json) "
            f"with {budget}: {_name_rows(too_long)}. Shorten or drop those rows"
            + (", or lower --rollout-max-response-len" if kind == "prompt" else ""))


def check_agent_supported(run_config: RunConfig, training_config: TrainingConfig) -> None:
    """--agent / --agent-command: the agent's sessions replace the generation of a rollout recipe, so
    the recipe draws prompts and rolls in nothing, the rollout is synchronous, and the engine records the
    sessions (`stacx serve`: the CPU server a run starts, or attached ones) or takes a recorder in front
    (vLLM: stacx.trainer.session_recorder)."""
    rollout = run_config.rollout
    flag = "--agent" if rollout.agent else "--agent-command"
    if not (rollout.agent or rollout.agent_command):
        return
    if rollout.agent and rollout.agent_command:
        raise PreflightError("--agent and --agent-command are both set; give one (a Python function, or a program)")
    if training_config.data_source != "rollout" or training_config.rollin_protocol is not None:
        raise PreflightError(f"{flag}: recipe {training_config.name!r} does not take its samples from the rollout "
                             "engine alone; an agent's sessions can replace the rollout of grpo, rloo, ppo and "
                             "the other policy-gradient recipes")
    if rollout.rollout_mode != "sync":
        raise PreflightError(f"{flag} runs with --rollout-mode sync (the agent draws its own turns); "
                             f"drop --rollout-mode {rollout.rollout_mode}")
    if rollout.dynamic_sampling:
        raise PreflightError(f"{flag} does not combine with --dynamic-sampling; drop one")
    try:
        engine_kind = resolve_engine_kind(rollout.rollout_engine)
    except ValueError:
        return  # an unknown --rollout-engine is reported by the engine check, with the known kinds
    if not engine_kind.serves_agents:
        raise PreflightError(f"{flag} needs an engine that records the agent's sessions (`stacx serve`, "
                             f"or a kind registered with records_sessions=True or "
                             f"sessions_through_recorder=True): --rollout-engine cpu, vllm, or http with "
                             f"--rollout-urls of stacx serve servers (got {engine_kind.name!r})")
    if rollout.agent and (rollout.agent_env or rollout.agent_timeout != RolloutSection.agent_timeout):
        given = "--agent-env" if rollout.agent_env else "--agent-timeout"
        raise PreflightError(f"{given} applies to an --agent-command program; an --agent function runs in this "
                             f"process with its environment and bounds its own time: drop {given}")
    try:
        agent = agent_from_settings(rollout.agent, rollout.agent_command, agent_timeout=rollout.agent_timeout,
                                    agent_env=rollout.agent_env)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    if isinstance(agent, AgentCommand) and shutil.which(agent.argv[0]) is None:
        raise PreflightError(f"--agent-command: program {agent.argv[0]!r} is not found (not a file, not on PATH)")
    unset = [name for name in rollout.agent_env if name not in os.environ]
    if unset:
        raise PreflightError(f"--agent-env {unset[0]}: no such variable in this process's environment; set it "
                             "before the run, or drop the flag")
