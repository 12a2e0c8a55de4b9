"""Checks that run before any worker, server or Ray cluster starts, the same for `--dry-run` and a real run.

    run_preflight(run_config, training_config, algorithm)   # raises PreflightError naming the flag

What it checks (each failure is one paragraph naming the flag and the fix):
- every checkpoint the roles start from exists (--hf-checkpoint, --ref-load, --critic-load, ...),
  and a reference is given when the algorithm has a KL term to it; a Hugging Face folder's model is a
  supported architecture and its safetensors files are whole; a role folder inside a training
  checkpoint matches its manifest's sizes;
- a resume agrees with its checkpoint (--num-steps, the mini-batch split, async --max-staleness:
  `stacx.trainer.resume_checks`);
- --load holds a complete checkpoint whose manifest.json parses (a truncated one is named);
- --save does not hold another run's checkpoints (unless --load resumes it or --overwrite), and no live
  run holds its lock (`stacx.trainer.save_lock`);
- --max-restarts comes with --save; --replay-rollouts names a dump folder other than --dump-rollouts
  (a replay skips the engine, teacher, reward and data checks below: it uses none of them);
- a recipe that scores rollouts with a teacher has --teacher-url (or a trajectory corpus to replay),
  the teacher answers `/health` within TEACHER_TIMEOUT_S, and its vocabulary matches the student's;
  --rollout-engine is a registered engine kind, and one that attaches (http) has --rollout-urls; vllm without
  --rollout-urls has its environment's python (--vllm-python); --vllm-weight-transfer other than auto comes
  with --rollout-engine vllm; --weight-check-every is >= 0;
  --reward-fn resolves; --wandb-project has the wandb package;
- the advantage estimator is registered, and no custom key is a misspelling of a knob the run's
  kernels declare (`check_objective_names`);
- --tensor-model-parallel-size and --context-parallel-size divide the model's attention heads
  (num_attention_heads and num_key_value_heads of --hf-checkpoint's config.json), and
  --pipeline-model-parallel-size divides its num_hidden_layers, and --num-layers-per-virtual-pipeline-stage
  (with a pipeline) divides each stage's layers;
- every --custom-module imports;
- --rollout-mode async is not combined with what it does not run yet (dataset recipes, roll-ins,
  dynamic sampling), and --partial-rollout comes with it;
- --global-batch-size x --num-steps-per-rollout equals the samples of a rollout (either one alone must
  divide them), see `stacx.trainer.config.mini_batches`;
- the data: --prompt-data exists and parses, and through `check_examples` (also called by
  `StepDataSource`, so Python callers get it too) every row has a label when the reward compares
  with one, and no prompt (plus --rollout-max-response-len) exceeds the model's context.

Range and type errors of single settings (`--rollout-batch-size 0`, a dict for a string) are
refused earlier, by `RunConfig.from_dict` (FIELD_MINIMUMS, and the sections' own checks in `__post_init__`:
--lora-dropout, the engine fault flags of `RolloutSection`).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Optional

import torch

from stacx.checkpointing.folders import HF, ModelFolderError, detect_model_folder, is_model_folder
from stacx.checkpointing.safetensors_check import SafetensorsError, check_safetensors_folder
from stacx.env_overrides import apply_env_overrides
from stacx.models.architectures import decoder_shape, load_hf_config, num_virtual_stages
from stacx.models.saved_tokenizer import load_saved_tokenizer
from stacx.objectives import load_custom_modules
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.objectives.registry import ADVANTAGES, OFF_POLICY_CORRECTIONS, POLICY_LOSSES
from stacx.plugins.registry import Registry
from stacx.rollout.asynchronous.async_rollout import check_async_supported
from stacx.rollout.data import MalformedRowError
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.engines.vllm import vllm_python
from stacx.rollout.rewards import resolve_reward_fn
from stacx.rollout.service import load_tokenizer
from stacx.specializations.actor import correction_names
from stacx.tasks.data import is_builtin, parse_builtin_spec, resolve_builtin_data
from stacx.trainer.batch import StepDataSource
from stacx.trainer.checkpoint import (
    CheckpointError,
    check_save_folder,
    read_manifest,
    resolve_checkpoint_folder,
    verify_start_folders,
)
from stacx.trainer.config.checks import PreflightError, check_agent_supported
from stacx.trainer.config.mini_batches import resolve_mini_batch_schedule
from stacx.trainer.config.recipe import TrainingConfig, role_checkpoint_path, role_wants_reference
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import CUSTOM_HYPERPARAMETERS_KEY, ConfigError, RunConfig
from stacx.trainer.resume_checks import check_resume
from stacx.trainer.rollout_dump import MANIFEST_NAME as DUMP_MANIFEST_NAME
from stacx.trainer.save_lock import SaveFolderInUse, check_save_folder_free
from stacx.wire.http_client import API_KEY_ENV

"""Offending rows named in a data error (the count says how many there are in all)."""

TEACHER_TIMEOUT_S = 10.0
"""Seconds the preflight waits for the teacher's `/health` and `/get_model_info` answers."""


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def run_preflight(run_config: RunConfig, training_config: TrainingConfig, algorithm: AlgorithmConfig, *,
                  load_data: bool = True) -> None:
    """Every check of the module doc; `load_data=False` skips reading the dataset (paths still checked)."""
    check_custom_modules(run_config)
    check_objective_names(algorithm)
    check_logging_sinks(run_config)
    check_checkpoints(run_config, training_config, algorithm)
    check_parallel_layout(run_config)
    check_expert_layout(run_config)
    check_routing_replay(run_config, training_config)
    check_resume(run_config)  # before the mini-batch check: a resume keeps the checkpoint's own split
    check_mini_batches(run_config, training_config)
    check_rollout_mode(run_config, training_config, algorithm)
    check_resume_and_save(run_config)
    check_restarts_and_dumps(run_config)
    if run_config.train.replay_rollouts:  # the batches come from the dump: no engine, teacher, reward or data
        return
    check_services(run_config, training_config)
    check_data_paths(run_config, training_config)
    if load_data:
        load_and_check_data(run_config, training_config)


# ---- objectives ----------------------------------------------------------------------------------

def check_objective_names(algorithm: AlgorithmConfig) -> None:
    """The run's advantage estimator is registered (after --custom-module files were imported): the
    loop looks it up only at its first step, after Ray and every worker have started. Then the
    custom keys the user set against the knobs the run's kernels declare (`check_algorithm_params`)."""
    if algorithm.advantage_estimator is not None:  # None: a recipe without advantages (sft, dpo, distillation)
        try:
            ADVANTAGES.get(algorithm.advantage_estimator)
        except ValueError as err:
            raise PreflightError(f"--advantage-estimator: {err} (register yours with @register_advantage and load "
                                 "its file with --custom-module)") from None
    check_algorithm_params(algorithm)
    check_padded_aggregation(algorithm)


def check_padded_aggregation(algorithm: AlgorithmConfig) -> None:
    """A padded policy-loss plugin that returns a scalar loss has aggregated it itself, with the mode it was
    registered with (`aggregation=`, default token-mean); it runs only under that `loss_agg_mode`. A mismatch failed
    at step 0 on every rank, after start-up: the plugin runs once here on a two-token trajectory instead (a plugin
    that returns per-token losses, or needs inputs this probe does not give, is left to the run)."""
    name = algorithm.policy_loss
    if not name or name not in POLICY_LOSSES:
        return
    kernel = POLICY_LOSSES.get(name)
    if getattr(kernel, "padded_plugin", None) is None:
        return
    one = [torch.zeros(2, dtype=torch.float32)]
    try:
        kernel(algorithm, one, one, one, [torch.ones(2, dtype=torch.float32)])
    except ValueError as err:
        if "loss_agg_mode" in str(err):
            raise PreflightError(f"--loss-agg-mode {algorithm.loss_agg_mode}: {err}") from None
    except Exception:  # noqa: BLE001 - the plugin's own needs are the run's to report
        pass


def run_kernels(algorithm: AlgorithmConfig) -> list[tuple[str, str, Registry]]:
    """(kind, name, registry) of every registered kernel the run's algorithm names: the advantage
    estimator, the policy loss and each off-policy correction (unknown names are left to their own checks)."""
    named = [("advantage estimator", algorithm.advantage_estimator, ADVANTAGES),
             ("policy loss", algorithm.policy_loss, POLICY_LOSSES)]
    named += [("off-policy correction", name, OFF_POLICY_CORRECTIONS)
              for name in correction_names(algorithm.off_policy_corrections)]
    return [(kind, name, registry) for kind, name, registry in named if name and name in registry]


def check_algorithm_params(algorithm: AlgorithmConfig) -> None:
    """A custom key the user set (--algorithm-param NAME=VALUE, `algorithm:` in YAML) that is a
    near-miss of a knob one of the run's kernels declares (`hyperparameters=` at registration, a
    padded plugin's named parameters) is a misspelling: the kernel would read its default. Keys
    listed in `algorithm.custom_hyperparameters` are meant as written. A key near no declared knob
    is left alone (a custom recipe's specialization may read it)."""
    knobs = {knob: (kind, name) for kind, name, registry in run_kernels(algorithm)
             for knob in registry.traits(name).hyperparameters}
    if not knobs:
        return
    declared_custom = set(algorithm.extras.get(CUSTOM_HYPERPARAMETERS_KEY) or ())
    for key in sorted(set(algorithm.extras) & set(algorithm.given_keys)):
        if key in knobs or key == CUSTOM_HYPERPARAMETERS_KEY or key in declared_custom:
            continue
        close = difflib.get_close_matches(key, list(knobs), n=1, cutoff=0.75)
        if close:
            kind, name = knobs[close[0]]
            raise PreflightError(
                f"--algorithm-param {key}: no kernel of this run reads '{key}', so it would have no effect; did you "
                f"mean '{close[0]}'? ({kind} {name!r} declares {', '.join(sorted(k for k in knobs if knobs[k] == knobs[close[0]]))}). "
                f"Fix the name, or list '{key}' under algorithm.{CUSTOM_HYPERPARAMETERS_KEY} if it is meant as written")


def is_importable(module_name: str) -> bool:
    """Whether `import module_name` would find the package, without importing it (wandb is slow to import)."""
    if module_name in sys.modules:
        return sys.modules[module_name] is not None
    return importlib.util.find_spec(module_name) is not None


def check_logging_sinks(run_config: RunConfig) -> None:
    """--wandb-project needs the wandb package; without it the run would fail after its workers started."""
    project = run_config.logging.wandb_project
    if project and not is_importable("wandb"):
        raise PreflightError(f"--wandb-project {project} is set, but the wandb package is not installed in this "
                             "Python environment; install it (pip install wandb) or drop --wandb-project")


# ---- checkpoints ---------------------------------------------------------------------------------

def _check_hf_folder(arg: str, path: str, role_name: str) -> None:
    if not os.path.isdir(path):
        raise PreflightError(f"{flag(arg)} {path}: no such folder (role {role_name!r} starts from this Hugging Face "
                             "checkpoint: config.json, weights, tokenizer). Fix the path or write the checkpoint first")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PreflightError(f"{flag(arg)} {path}: the folder has no config.json, so it is not a Hugging Face "
                             f"checkpoint (role {role_name!r} starts from it, and the tokenizer and the model's "
                             f"config are read from it); point {flag(arg)} at one")
    _check_hf_contents(arg, path)


def _check_hf_contents(arg: str, path: str) -> None:
    """A Hugging Face folder's model is one Stacx builds (its config.json: architecture and features), and
    its safetensors files are whole: both would otherwise fail on every rank after start-up."""
    try:
        decoder_shape(load_hf_config(path))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise PreflightError(f"{flag(arg)} {path}: {err}. Stacx builds the decoders listed in docs/models.md; "
                             f"point {flag(arg)} at a checkpoint of one of them") from None
    try:
        check_safetensors_folder(path, flag=flag(arg))
    except SafetensorsError as err:
        raise PreflightError(str(err)) from None


def _check_model_folder(arg: str, path: str, use: str) -> None:
    """A folder of either layout (Hugging Face, or torch_dist flat or in Megatron-LM's tracker layout);
    one without config.json is built with --hf-checkpoint's config. `use` says which role reads it how."""
    if not os.path.isdir(path):
        raise PreflightError(f"{flag(arg)} {path}: no such folder ({use}). Fix the path or write the checkpoint first")
    try:
        kind = detect_model_folder(path, flag=flag(arg))
    except ModelFolderError as err:
        raise PreflightError(f"{err} ({use})") from None
    if kind == HF:
        _check_hf_contents(arg, path)


def check_checkpoints(run_config: RunConfig, training_config: TrainingConfig, algorithm: AlgorithmConfig) -> None:
    """The folders every role starts from, and the reference when a KL term needs one."""
    model = run_config.model
    if model.hf_checkpoint is None:
        raise PreflightError("--hf-checkpoint is not set: every role starts from it and the driver reads its "
                             "tokenizer; give a Hugging Face checkpoint folder")
    for arg, message in unread_checkpoint_flags(run_config, training_config).items():
        if not os.path.exists(getattr(model, arg)):
            raise PreflightError(f"{message}; and {getattr(model, arg)} does not exist")
    for role in training_config.roles:
        path = role_checkpoint_path(role, model)
        if path is None:
            raise PreflightError(f"{flag(role.checkpoint_arg)} is not set: role {role.name!r} starts from it")
        if role.checkpoint_arg == "hf_checkpoint":
            _check_hf_folder(role.checkpoint_arg, path, role.name)
        else:
            _check_model_folder(role.checkpoint_arg, path, f"role {role.name!r} starts from its weights")
        arg = role.reference_checkpoint_arg
        wants = role_wants_reference(role, training_config, algorithm)
        reference = role_checkpoint_path(role, model, arg) if arg is not None else None
        if wants and reference is None:
            raise PreflightError(f"{flag(arg or 'ref_load')} is not set, but role {role.name!r} needs reference "
                                 "log-probs (its loss, use_kl_loss or use_kl_in_reward); set it to the reference "
                                 "checkpoint or turn the KL term off")
        if reference is not None:  # the role's workers load it whenever it is given
            _check_model_folder(arg, reference, f"role {role.name!r} computes its reference log-probs with these "
                                                "weights")
    try:  # a role folder inside a training checkpoint against its manifest (sizes; the run checks hashes too)
        verify_start_folders(model, training_config, check_hash=False)
    except CheckpointError as err:
        raise PreflightError(str(err)) from None


def unread_checkpoint_flags(run_config: RunConfig, training_config: TrainingConfig) -> dict[str, str]:
    """Checkpoint flags that are set but that no role of the recipe reads (field -> what to tell the
    user): the run ignores them. `stacx train` warns about each; preflight refuses one whose path is missing."""
    read = {arg for role in training_config.roles for arg in (role.checkpoint_arg, role.reference_checkpoint_arg)}
    unread = {}
    for arg in ("ref_load", "critic_load"):
        value = getattr(run_config.model, arg)
        if value is not None and arg not in read:
            unread[arg] = (f"{flag(arg)} {value} is set, but recipe {training_config.name!r} has no role that reads it "
                           f"(its roles: {', '.join(r.name for r in training_config.roles)}), so the run ignores it: "
                           f"drop {flag(arg)}, or pick a recipe that uses it (`stacx recipes` lists each recipe's roles)")
    return unread


def ignored_settings(run_config: RunConfig) -> list[str]:
    """Settings given that the run does not use (one message each, naming the flag and the fix):
    `stacx train` prints each as a warning, --dry-run included. --max-staleness bounds async rollouts only."""
    rollout = run_config.rollout
    messages = []
    default_staleness = type(rollout)().max_staleness
    if (rollout.rollout_mode != "async" and "max_staleness" in run_config.given_keys
            and rollout.max_staleness != default_staleness):
        messages.append(f"--max-staleness {rollout.max_staleness} is set, but --rollout-mode is {rollout.rollout_mode!r}: "
                        "it bounds the staleness of asynchronous rollouts only, so this run ignores it; add "
                        "--rollout-mode async, or drop --max-staleness")
    return messages


def read_model_config(hf_checkpoint: Optional[str]) -> dict:
    """The checkpoint's config.json as a dict ({} when absent or unreadable)."""
    if not hf_checkpoint:
        return {}
    try:
        with open(os.path.join(hf_checkpoint, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def check_parallel_layout(run_config: RunConfig) -> None:
    """TP splits the attention heads (query and key/value) across ranks; CP (megatron's ring/a2a
    attention) needs the same heads per rank, so both degrees must divide the heads of config.json;
    PP gives each stage the same number of layers, so it must divide num_hidden_layers, and virtual stages
    split each stage's layers evenly again."""
    config = read_model_config(run_config.model.hf_checkpoint)
    heads = {key: config.get(key) for key in ("num_attention_heads", "num_key_value_heads")}
    heads = {key: value for key, value in heads.items() if isinstance(value, int) and value > 0}
    parallel = run_config.parallel
    for field_name in ("tensor_model_parallel_size", "context_parallel_size"):
        size = getattr(parallel, field_name)
        for key, num_heads in heads.items():
            if num_heads % size:
                divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
                raise PreflightError(
                    f"{flag(field_name)} {size} does not divide the model's {key} {num_heads} "
                    f"({run_config.model.hf_checkpoint}/config.json); use one of {divisors}")
    num_layers = config.get("num_hidden_layers")
    stages = parallel.pipeline_model_parallel_size
    if isinstance(num_layers, int) and num_layers > 0 and num_layers % stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise PreflightError(
            f"{flag('pipeline_model_parallel_size')} {stages} does not divide the model's num_hidden_layers "
            f"{num_layers} ({run_config.model.hf_checkpoint}/config.json): every stage holds as many layers; "
            f"use one of {divisors}")
    layers_per_virtual_stage = run_config.model.num_layers_per_virtual_pipeline_stage
    if layers_per_virtual_stage is not None and isinstance(num_layers, int) and num_layers > 0:
        try:
            num_virtual_stages(num_layers, stages, layers_per_virtual_stage)
        except ValueError as err:
            raise PreflightError(f"{err} ({run_config.model.hf_checkpoint}/config.json)") from None


def check_expert_layout(run_config: RunConfig) -> None:
    """A mixture-of-experts model's experts spread evenly over --expert-model-parallel-size, each expert's width
    over --expert-tensor-parallel-size, and ep x etp divides the role's ranks (megatron's expert grid);
    a dense model takes neither flag above 1."""
    config = read_model_config(run_config.model.hf_checkpoint)
    parallel = run_config.parallel
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    # Hub configs name it num_experts; transformers 5 writes num_local_experts.
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    num_experts = num_experts if isinstance(num_experts, int) else 0
    if not num_experts:
        if ep > 1 or (parallel.expert_tensor_parallel_size or 1) > 1:
            raise PreflightError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size "
                                 f"{parallel.expert_tensor_parallel_size} need a mixture-of-experts model; "
                                 f"{run_config.model.hf_checkpoint}/config.json has no num_experts (leave both at 1)")
        return
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise PreflightError(f"--expert-model-parallel-size {ep} does not divide the model's num_experts {num_experts} "
                             f"({run_config.model.hf_checkpoint}/config.json); use one of {divisors}")
    width = config.get("moe_intermediate_size")
    if isinstance(width, int) and width % etp:
        raise PreflightError(f"--expert-tensor-parallel-size {etp} does not divide the model's moe_intermediate_size "
                             f"{width} ({run_config.model.hf_checkpoint}/config.json)")
    world = parallel.tensor_model_parallel_size * parallel.context_parallel_size * parallel.data_parallel_size
    if world % (ep * etp):
        raise PreflightError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does not divide "
                             f"the role's {world} ranks (--tensor-model-parallel-size x --context-parallel-size x "
                             "--data-parallel-size); megatron lays the experts over those same ranks")
    if parallel.tensor_model_parallel_size > 1 and not run_config.model.sequence_parallel:
        raise PreflightError(f"--tensor-model-parallel-size {parallel.tensor_model_parallel_size} with a "
                             "mixture-of-experts model needs sequence parallelism (megatron's MoE layer requires it "
                             "at tp > 1): add --sequence-parallel, or use --tensor-model-parallel-size 1 and spread "
                             "the experts with --expert-model-parallel-size")


def check_routing_replay(run_config: RunConfig, training_config: TrainingConfig) -> None:
    """--use-routing-replay needs routed experts (a mixture-of-experts model) and a rollout that returns
    them for every sample: single-turn generations (sync or async), not environment-driven roll-ins or agents."""
    rollout = run_config.rollout
    if not rollout.use_routing_replay:
        return
    config = read_model_config(run_config.model.hf_checkpoint)
    if config and not (config.get("num_experts") or config.get("num_local_experts")):
        raise PreflightError(f"--use-routing-replay needs a mixture-of-experts model; "
                             f"{run_config.model.hf_checkpoint}/config.json has no num_experts (drop the flag)")
    if rollout.agent or rollout.agent_command:
        raise PreflightError("--use-routing-replay with --agent / --agent-command: agent turns come through the "
                             "OpenAI-compatible endpoint, which returns no routed experts yet; drop the flag")
    if training_config.rollin_protocol is not None:
        raise PreflightError(f"--use-routing-replay with the {training_config.rollin_protocol!r} roll-in of recipe "
                             f"{training_config.name!r}: roll-ins return no routed experts yet; drop the flag")


def check_mini_batches(run_config: RunConfig, training_config: TrainingConfig) -> None:
    """--global-batch-size / --num-steps-per-rollout fit the rollout (`resolve_mini_batch_schedule`), and a
    mini-batch holds a sample for every data-parallel rank."""
    try:
        schedule = resolve_mini_batch_schedule(run_config.rollout, run_config.train,
                                               data_source=training_config.data_source)
    except ConfigError as err:
        raise PreflightError(str(err)) from None
    dp_size = run_config.parallel.data_parallel_size
    if schedule.optimizer_steps_per_rollout > 1 and schedule.global_batch_size < dp_size:
        raise PreflightError(f"--global-batch-size {schedule.global_batch_size} gives each optimizer step fewer samples "
                             f"than --data-parallel-size {dp_size} ranks; lower --num-steps-per-rollout or "
                             "--data-parallel-size")


def check_rollout_mode(run_config: RunConfig, training_config: TrainingConfig, algorithm: AlgorithmConfig) -> None:
    """--rollout-mode async refuses what it does not run yet (dataset recipes, roll-ins, dynamic
    sampling) and --partial-rollout without it (`check_async_supported`)."""
    try:
        check_async_supported(run_config.rollout, rollout_plan(training_config, run_config), algorithm)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    check_agent_supported(run_config, training_config)


def check_custom_modules(run_config: RunConfig) -> None:
    """Every --custom-module imports (loading an already imported file again is a no-op)."""
    if not run_config.train.custom_module:
        return

    try:
        load_custom_modules(list(run_config.train.custom_module))
    except ValueError as err:
        raise PreflightError(f"{err}; fix the module or drop --custom-module") from None


def check_resume_and_save(run_config: RunConfig) -> None:
    """--save must not be held by a live run, nor hold another run's checkpoints; --load must hold a complete
    checkpoint with a readable manifest."""
    model = run_config.model
    if os.environ.get("RANK", "0") == "0":  # the process that will hold the lock (torchrun: rank 0 holds it)
        try:
            check_save_folder_free(model.save)
        except SaveFolderInUse as err:
            raise PreflightError(str(err)) from None
    if model.load:
        if not os.path.exists(model.load):
            raise PreflightError(f"--load {model.load}: no such folder; give a checkpoint root or step_* folder "
                                 "written by --save, or drop --load to start fresh")
        if is_model_folder(model.load):  # a Hugging Face or torch_dist model: the rollout role's start weights
            _check_model_folder("load", model.load, "the rollout role, else the first trainable one, starts from its "
                                                  "weights at step 0")
        else:
            try:
                read_manifest(resolve_checkpoint_folder(model.load))
            except CheckpointError as err:
                raise PreflightError(f"--load {model.load}: {err}") from None
    try:
        check_save_folder(model.save, load=model.load, overwrite=model.overwrite)
    except CheckpointError as err:
        raise PreflightError(str(err)) from None


# ---- services and data ---------------------------------------------------------------------------

def replays_trajectories(run_config: RunConfig, training_config: TrainingConfig) -> bool:
    """True when online_dagger replays a saved teacher corpus (no engine, no teacher server)."""
    teacher = apply_env_overrides(run_config.teacher)
    return training_config.rollin_protocol == "teacher_relabel" and teacher.dagger_sft_mode == "trajectory"


def check_restarts_and_dumps(run_config: RunConfig) -> None:
    """--max-restarts needs --save (a restart resumes its newest checkpoint); --replay-rollouts names a dump
    folder and is not the folder --dump-rollouts writes (docs/rollout_dumps.md)."""
    train = run_config.train
    if train.max_restarts and not run_config.model.save:
        raise PreflightError(f"--max-restarts {train.max_restarts} restarts the run from its newest checkpoint in "
                             "--save; give --save DIR (and --save-interval N to checkpoint every N steps)")
    if train.replay_rollouts:
        if not os.path.isfile(os.path.join(train.replay_rollouts, DUMP_MANIFEST_NAME)):
            raise PreflightError(f"--replay-rollouts {train.replay_rollouts}: no {DUMP_MANIFEST_NAME} there; give a "
                                 "folder a run wrote with --dump-rollouts")
        if train.dump_rollouts and os.path.realpath(train.dump_rollouts) == os.path.realpath(train.replay_rollouts):
            raise PreflightError(f"--dump-rollouts and --replay-rollouts name the same folder "
                                 f"({train.replay_rollouts}); drop --dump-rollouts or dump into another folder")


def check_services(run_config: RunConfig, training_config: TrainingConfig) -> None:
    """Teacher URL, rollout URLs, the reward function and the roll-in settings of rollout recipes."""
    if training_config.data_source != "rollout":
        return
    if replays_trajectories(run_config, training_config):
        if not run_config.teacher.trajectory_corpus:
            raise PreflightError("dagger_sft_mode 'trajectory' replays a saved teacher corpus; set "
                                 "--trajectory-corpus to its JSONL file")
        if not os.path.isfile(run_config.teacher.trajectory_corpus):
            raise PreflightError(f"--trajectory-corpus {run_config.teacher.trajectory_corpus}: no such file")
        return
    if training_config.uses_teacher and not run_config.teacher.teacher_url:
        raise PreflightError(f"--teacher-url is not set: recipe {training_config.name!r} scores rollouts with a "
                             "teacher server; start one (`stacx serve --hf-checkpoint TEACHER`) and pass its URL")
    if training_config.uses_teacher:
        try:
            resolve_engine_kind(run_config.teacher.teacher_engine, flag="--teacher-engine")
        except ValueError as err:
            raise PreflightError(str(err)) from None
        check_teacher(run_config.teacher.teacher_url, run_config.model.hf_checkpoint)
    try:
        engine_kind = resolve_engine_kind(run_config.rollout.rollout_engine)  # custom modules are loaded by now
    except ValueError as err:
        raise PreflightError(str(err)) from None
    if engine_kind.attaches and not run_config.rollout.rollout_urls:
        raise PreflightError(f"--rollout-engine {engine_kind.name} attaches to running servers; give them with "
                             "--rollout-urls")
    if engine_kind.name == "vllm" and not run_config.rollout.rollout_urls:
        try:
            vllm_python(run_config.rollout.vllm_python)  # the run starts vLLM's server from its own environment
        except ValueError as err:
            raise PreflightError(str(err)) from None
    if run_config.rollout.vllm_weight_transfer != "auto" and engine_kind.name != "vllm":
        raise PreflightError(f"--vllm-weight-transfer {run_config.rollout.vllm_weight_transfer}: only the vllm engine "
                             f"takes it (this run's is --rollout-engine {engine_kind.name}); drop it")
    if run_config.rollout.weight_check_every < 0:
        raise PreflightError(f"--weight-check-every must be >= 0 (0: never), got {run_config.rollout.weight_check_every}")
    if training_config.uses_reward:
        try:
            resolve_reward_fn(run_config.rollout.reward_fn)
        except ValueError as err:
            raise PreflightError(f"--reward-fn: {err}") from None

    try:
        rollout_plan(training_config, run_config)  # resolves the roll-in: its mode and schedule
    except ValueError as err:
        raise PreflightError(str(err)) from None


def _get_json(url: str, timeout_s: float) -> tuple[int, Any]:
    """(HTTP status, parsed JSON body or None) of a GET; raises OSError when nothing answers."""
    request = urllib.request.Request(url)
    api_key = os.environ.get(API_KEY_ENV)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, None


def teacher_vocabulary(model_info: Any) -> tuple[Optional[dict], Optional[int]]:
    """(token -> id of the teacher's tokenizer, vocab_size) from its `/get_model_info` answer: the
    tokenizer of its local `tokenizer_path`/`model_path` folder, `vocab_size` if the server gives it."""
    if not isinstance(model_info, dict):
        return None, None
    vocab_size = model_info.get("vocab_size")
    vocab_size = vocab_size if isinstance(vocab_size, int) else None
    folder = model_info.get("tokenizer_path") or model_info.get("model_path")
    if isinstance(folder, str) and os.path.isdir(folder):
        vocab_size = vocab_size or read_model_config(folder).get("vocab_size")
        try:
            return load_saved_tokenizer(folder).get_vocab(), vocab_size
        except Exception:  # noqa: BLE001 - no readable tokenizer there: compare sizes only
            return None, vocab_size
    return None, vocab_size


def teacher_model_info(base: str, timeout_s: float) -> Any:
    """The teacher's `/get_model_info` answer (`stacx serve`, SGLang), or for an OpenAI-compatible server
    without it (vLLM) `{"model_path": ...}` from the `root` of its first `/v1/models` entry; None when
    neither says. Raises OSError when the server stops answering."""
    status, model_info = _get_json(base + "/get_model_info", timeout_s)
    if status == 200:
        return model_info
    status, models = _get_json(base + "/v1/models", timeout_s)
    entries = models.get("data") if status == 200 and isinstance(models, dict) else None
    if isinstance(entries, list) and entries and isinstance(entries[0], dict) and entries[0].get("root"):
        return {"model_path": entries[0]["root"]}
    return None


def check_teacher(teacher_url: str, hf_checkpoint: Optional[str], *, timeout_s: float = TEACHER_TIMEOUT_S) -> None:
    """The teacher answers GET /health with 200 within timeout_s, and its tokenizer maps every token to
    the same id as the student's (or, when only sizes are known, its vocab_size equals the student's)."""
    base = teacher_url.rstrip("/")
    try:
        status, _ = _get_json(base + "/health", timeout_s)
    except OSError as err:
        raise PreflightError(f"--teacher-url {teacher_url}: no answer from {base}/health within {timeout_s:g} s "
                             f"({err}); start the teacher server (`stacx serve --hf-checkpoint TEACHER`) or fix "
                             "the URL") from None
    if status != 200:
        raise PreflightError(f"--teacher-url {teacher_url}: {base}/health answered {status}, not 200; wait until "
                             "the teacher is ready or restart it")
    try:
        model_info = teacher_model_info(base, timeout_s)
    except OSError:
        return  # /health answered: a server without /get_model_info is not refused
    teacher_vocab, teacher_size = teacher_vocabulary(model_info)
    student_size = read_model_config(hf_checkpoint).get("vocab_size")
    if teacher_vocab is not None and hf_checkpoint:
        try:
            student_vocab = load_saved_tokenizer(hf_checkpoint).get_vocab()
        except Exception:  # noqa: BLE001 - the data check names a missing student tokenizer
            student_vocab = None
        if student_vocab is not None and student_vocab != teacher_vocab:
            differing = sorted(t for t in set(student_vocab) | set(teacher_vocab)
                               if student_vocab.get(t) != teacher_vocab.get(t))
            raise PreflightError(
                f"--teacher-url {teacher_url}: the teacher's tokenizer ({model_info.get('model_path')}) differs from "
                f"the student's (--hf-checkpoint {hf_checkpoint}) in {len(differing)} token(s), e.g. "
                f"{differing[:3]}; distillation compares log-probs token id by token id, so serve a teacher "
                "with the student's tokenizer")
        return
    if teacher_size is not None and isinstance(student_size, int) and teacher_size != student_size:
        raise PreflightError(
            f"--teacher-url {teacher_url}: the teacher's vocab_size {teacher_size} differs from the student's "
            f"{student_size} (--hf-checkpoint {hf_checkpoint}/config.json); serve a teacher with the student's "
            "tokenizer")


def _needs_prompt_data(run_config: RunConfig, training_config: TrainingConfig) -> bool:
    return not (training_config.data_source == "rollout" and replays_trajectories(run_config, training_config))


def check_data_paths(run_config: RunConfig, training_config: TrainingConfig) -> None:
    """--prompt-data (and --eval-data when evaluating) exist; built-in tasks are always there."""
    rollout = run_config.rollout
    if _needs_prompt_data(run_config, training_config):
        if not rollout.prompt_data:
            raise PreflightError(f"--prompt-data is not set: recipe {training_config.name!r} reads its "
                                 "examples from a JSONL or Parquet file (or builtin:<task>)")
        _check_data_file("prompt_data", rollout.prompt_data)
    if rollout.eval_interval and rollout.eval_data:
        _check_data_file("eval_data", rollout.eval_data)


def _check_data_file(field_name: str, path: str) -> None:
    if is_builtin(path):
        try:
            parse_builtin_spec(path)
        except (KeyError, ValueError) as err:
            raise PreflightError(f"{flag(field_name)} {path}: {err}") from None
        return
    if not os.path.isfile(path):
        raise PreflightError(f"{flag(field_name)} {path}: no such file (a JSONL or Parquet file, or builtin:<task>)")


def load_and_check_data(run_config: RunConfig, training_config: TrainingConfig) -> None:
    """Read the data as the run will (StepDataSource, which calls `check_examples`); errors name the flag.

    A dry run writes nothing: a built-in task's rows are written to a scratch folder for the check,
    not under --out (a real run writes them there, where its rollouts name them)."""
    if run_config.train.dry_run:
        import dataclasses
        import tempfile

        with tempfile.TemporaryDirectory(prefix="stacx-dry-run-") as scratch:
            scratch_config = dataclasses.replace(run_config, logging=dataclasses.replace(run_config.logging, out=scratch))
            _load_and_check_resolved_data(resolve_builtin_data(scratch_config), training_config)
        return
    _load_and_check_resolved_data(resolve_builtin_data(run_config), training_config)


def _load_and_check_resolved_data(run_config: RunConfig, training_config: TrainingConfig) -> None:
    try:
        tokenizer = load_tokenizer(run_config.model.hf_checkpoint)
        StepDataSource(run_config, training_config, tokenizer)
    except PreflightError:
        raise
    except (MalformedRowError, ValueError, FileNotFoundError, OSError) as err:
        raise PreflightError(f"--prompt-data {run_config.rollout.prompt_data}: {err}") from None
