"""`stacx eval`: evaluate a finished checkpoint on held-out prompts, outside training.

    stacx eval --hf-checkpoint outputs/grpo/export --task sorting
    stacx eval --load outputs/grpo/checkpoints/step_000000039 --eval-data data/eval.jsonl --n-samples 4
    stacx eval --load outputs/grpo/checkpoints --task sorting --out grpo_eval.json    # the newest step
    stacx eval --hf-checkpoint outputs/grpo/export --task sorting --engine-url http://127.0.0.1:30000

The checkpoint runs in this process on the CPU engine (Stacx's own model, the trainer's code
path), and the metrics are those of evaluation during training (`stacx.rollout.evaluation`):
`eval/mean_reward`, `eval/pass@1`, `eval/pass@<n>` (unbiased estimator over --n-samples) and
`eval/reward_errors`. They are printed; --out FILE also writes them as JSON, with the first samples
decoded so the answers can be read (without --out nothing is written). `--load` takes a training checkpoint (a `step_*` folder of
`--save`, or the folder holding them); its config and tokenizer come from the checkpoint the run
started from (recorded in its run_config.json; --hf-checkpoint names it if it moved).

`--engine-url URL` generates on a running server instead of loading the model here, through the
client of the engine kind `--engine-kind` names (default 'http': any SGLang-compatible server,
SGLang or `stacx serve`; a kind registered in a `--custom-module` file works the same way, see
docs/adding-an-engine.md); --hf-checkpoint then names the folder whose tokenizer encodes the
prompts and decodes the answers (the model the server runs).
Prompts go to the engine --batch-size at a time; a progress bar on stderr counts them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HELP = "evaluate a checkpoint (--hf-checkpoint or a training --load) on held-out prompts: reward, pass@k as JSON"

NUM_SAMPLES_SHOWN = 8
"""Decoded samples written to the JSON next to the metrics."""


class EvalUsageError(ValueError):
    """A flag combination or value `stacx eval` cannot use; the message names the flag."""


def add_arguments(parser) -> None:
    model = parser.add_argument_group("model (one of --hf-checkpoint, --load)")
    model.add_argument("--hf-checkpoint", help="Hugging Face folder (config.json, safetensors, tokenizer) to evaluate; "
                                               "with --load: the folder the run started from, if it moved")
    model.add_argument("--load", help="training checkpoint: a step_* folder written by --save, or the --save folder "
                                      "(its newest step)")
    model.add_argument("--role", help="role of a --load checkpoint to evaluate (default: its only role, else "
                                      "policy or actor)")
    data = parser.add_argument_group("prompts (one of --eval-data, --task)")
    data.add_argument("--eval-data", help="prompt rows, JSONL or Parquet (docs/data.md), or builtin:TASK/eval")
    data.add_argument("--task", help="a built-in task's held-out prompts (stacx.tasks), e.g. sorting")
    data.add_argument("--input-key", default="prompt", help="row key of the prompt (default: %(default)s)")
    data.add_argument("--label-key", default="label", help="row key of the label (default: %(default)s)")
    data.add_argument("--metadata-key", default="metadata", help="row key of the metadata (default: %(default)s)")
    data.add_argument("--apply-chat-template", action="store_true", help="render prompts with the chat template")
    data.add_argument("--num-prompts", type=int, default=None, help="evaluate the first N prompts (default: all)")
    sampling = parser.add_argument_group("sampling and scoring")
    sampling.add_argument("--n-samples", type=int, default=1, help="samples per prompt; pass@n uses them "
                                                                   "(default: %(default)s)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    sampling.add_argument("--max-new-tokens", type=int, default=None,
                          help="longest response (default: the task's longest answer + 1 with --task, else 64 "
                               "or what the model's context leaves after the longest prompt, if less)")
    sampling.add_argument("--reward-fn", default="exact_match",
                          help="registered reward name or module:function (default: %(default)s)")
    sampling.add_argument("--correct-threshold", type=float, default=0.5,
                          help="a sample counts as correct for pass@k when its reward is above this "
                               "(default: %(default)s)")
    sampling.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine-url", default=None,
                        help="generate on this running SGLang-compatible server (SGLang or `stacx serve`) instead of "
                             "the CPU engine in this process; needs --hf-checkpoint for the tokenizer")
    engine.add_argument("--engine-kind", default=None, metavar="KIND",
                        help="the registered engine kind whose client talks to --engine-url (default: http; "
                             "kinds of --custom-module files count)")
    engine.add_argument("--custom-module", action="append", default=[], metavar="FILE_OR_MODULE",
                        help="a Python file or module to import first, e.g. one registering an engine kind or a "
                             "reward (repeatable)")
    engine.add_argument("--batch-size", type=int, default=8,
                        help="prompts sent to the engine at once; the progress bar advances per batch "
                             "(default: %(default)s)")
    engine.add_argument("--no-progress-bar", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--out", default=None,
                        help="JSON file to write the report to, the metrics with the first decoded samples "
                             "(default: print the metrics only, write nothing)")


def validate_args(args) -> None:
    """EvalUsageError naming the flag for a missing, conflicting or out-of-range setting."""
    if args.hf_checkpoint is None and args.load is None:
        raise EvalUsageError("give the model to evaluate: --hf-checkpoint FOLDER or --load RUN/checkpoints/step_N")
    if args.role is not None and args.load is None:
        raise EvalUsageError("--role selects a role of a --load checkpoint; drop it or add --load")
    if (args.eval_data is None) == (args.task is None):
        raise EvalUsageError("give exactly one of --eval-data FILE and --task NAME"
                             + (f" (got both: {args.eval_data!r}, {args.task!r})" if args.task else ""))
    if args.engine_url is not None:
        if args.load is not None:
            raise EvalUsageError("--engine-url evaluates the model a server already runs; --load would export a "
                                 "checkpoint that is never used: drop --load and give --hf-checkpoint FOLDER (the "
                                 "served model's folder, for its tokenizer)")
        if not args.engine_url.startswith(("http://", "https://")):
            raise EvalUsageError(f"--engine-url {args.engine_url!r}: give an http:// or https:// URL, e.g. "
                                 "http://127.0.0.1:30000")
    elif args.engine_kind is not None:
        raise EvalUsageError(f"--engine-kind {args.engine_kind} names the client of a running server; add "
                             "--engine-url URL, or drop --engine-kind to run the model here on the CPU engine")
    for flag, value, minimum in (("--n-samples", args.n_samples, 1), ("--num-prompts", args.num_prompts, 1),
                                 ("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1)):
        if value is not None and value < minimum:
            raise EvalUsageError(f"{flag} must be >= {minimum}, got {value}")
    if args.temperature < 0:
        raise EvalUsageError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.out:  # without --out nothing is written
        check_out_writable(args.out)


def check_out_writable(path: str) -> None:
    """EvalUsageError when --out could not be written after the evaluation: a folder, a read-only file, or a
    folder (or the nearest existing one above it) this user cannot write into. Creates nothing."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise EvalUsageError(f"--out {path}: is a folder; give a file path, e.g. {os.path.join(path, 'eval.json')}")
    if os.path.exists(target):
        if not os.access(target, os.W_OK):
            raise EvalUsageError(f"--out {path}: the file is not writable by this user; choose another --out")
        return
    folder = os.path.dirname(target)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise EvalUsageError(f"--out {path}: cannot write into {folder} (no write permission, or not a folder); "
                             "choose another --out")


def resolve_model_folder(args, scratch_dir: str) -> tuple[str, str]:
    """(Hugging Face folder to load, description for the report); a --load step is exported under scratch_dir."""
    from stacx.models.checkpoint import require_hf_checkpoint_folder

    if args.load is None:
        return require_hf_checkpoint_folder(args.hf_checkpoint), args.hf_checkpoint
    from stacx.trainer.checkpoint import read_manifest, resolve_checkpoint_folder
    from stacx.trainer.checkpoint_export import base_checkpoint_of, export_role_to_hf, pick_role

    if not os.path.exists(args.load):
        raise EvalUsageError(f"--load {args.load}: folder not found (looked for {os.path.abspath(args.load)})")
    step_folder = resolve_checkpoint_folder(args.load)
    role = pick_role(read_manifest(step_folder), args.role)
    base = base_checkpoint_of(step_folder, args.hf_checkpoint)
    folder = export_role_to_hf(step_folder, role, base, os.path.join(scratch_dir, "model"))
    return folder, f"{step_folder} (role {role})"


DEFAULT_MAX_NEW_TOKENS = 64


def default_response_budget(examples, context: int | None) -> int:
    """DEFAULT_MAX_NEW_TOKENS, or what the model's context leaves after the longest prompt if less (at least 1)."""
    if context is None or not examples:
        return DEFAULT_MAX_NEW_TOKENS
    longest_prompt = max(len(example.prompt_ids) for example in examples)
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, context - longest_prompt))


def resolve_eval_data(args, scratch_dir: str) -> tuple[str, int | None]:
    """(prompt file, default max_new_tokens of its task or None); --task is builtin:TASK/eval."""
    from stacx.tasks.data import is_builtin, parse_builtin_spec, resolve_data_path

    spec = f"builtin:{args.task}/eval" if args.task is not None else args.eval_data
    flag = "--task" if args.task is not None else "--eval-data"
    if is_builtin(spec):
        try:
            task = parse_builtin_spec(spec).task
        except ValueError as err:
            raise EvalUsageError(f"{flag}: {err}") from None
        return resolve_data_path(spec, out_dir=scratch_dir), task.max_answer_chars + 1
    if not os.path.isfile(spec):
        raise EvalUsageError(f"--eval-data {spec}: file not found (looked for {os.path.abspath(spec)})")
    return spec, None


def evaluate_checkpoint(args) -> dict:
    """Load the model and prompts, generate, score; returns the JSON report (also written to --out)."""
    import dataclasses

    from stacx.rollout.data import DataConfig, load_examples
    from stacx.rollout.evaluation import evaluation_metrics
    from stacx.rollout.manager import RolloutManager
    from stacx.rollout.rewards import resolve_reward_fn
    from stacx.rollout.types import SamplingParams
    from stacx.rollout.service import load_tokenizer
    from stacx.trainer.config.checks import (PreflightError, check_labels_for_reward, check_prompts_not_empty,
                                             model_context_length)

    with tempfile.TemporaryDirectory(prefix="stacx-eval-") as scratch_dir:
        data_path, task_max_new_tokens = resolve_eval_data(args, scratch_dir)
        try:
            reward_fn = resolve_reward_fn(args.reward_fn)
        except ValueError as err:
            raise EvalUsageError(f"--reward-fn: {err}") from None
        model_folder, model_description = resolve_model_folder(args, scratch_dir)
        tokenizer = load_tokenizer(model_folder)
        examples = load_examples(DataConfig(path=data_path, kind="prompt", input_key=args.input_key,
                                            label_key=args.label_key, metadata_key=args.metadata_key,
                                            apply_chat_template=args.apply_chat_template), tokenizer)
        examples = examples[: args.num_prompts] if args.num_prompts else examples
        try:  # the same refusals as training's preflight
            check_prompts_not_empty(examples, data_flag="--eval-data", data_path=data_path)
            check_labels_for_reward(examples, reward_fn, reward_name=args.reward_fn, data_flag="--eval-data",
                                    data_path=data_path, label_key=args.label_key)
        except PreflightError as err:
            raise EvalUsageError(str(err)) from None
        default_max_new_tokens = default_response_budget(examples, model_context_length(model_folder))
        engine = open_engine(args, model_folder)
    eos = getattr(tokenizer, "eos_token_id", None)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens or task_max_new_tokens or default_max_new_tokens,
                              temperature=args.temperature, stop_token_ids=(eos,) if eos is not None else ())
    manager = RolloutManager(engine, tokenizer=tokenizer, reward_fn=reward_fn, seed=args.seed)
    try:
        samples = generate_in_batches(manager, examples, sampling, n_samples=args.n_samples,
                                      batch_size=args.batch_size, progress_bar=not args.no_progress_bar)
    finally:
        engine.shutdown()
    metrics = evaluation_metrics(samples, num_prompts=len(examples), n_samples=args.n_samples,
                                 correct_threshold=args.correct_threshold, prefix="eval")
    return {
        "checkpoint": model_description,
        "engine": args.engine_url or "cpu",
        "eval_data": args.eval_data if args.task is None else f"builtin:{args.task}/eval",
        "num_prompts": len(examples),
        "n_samples": args.n_samples,
        "sampling": dataclasses.asdict(sampling),
        "reward_fn": args.reward_fn,
        "metrics": metrics,
        "samples": [{"prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True), "response": s.response_text,
                     "label": s.label, "reward": s.reward, "reward_error": s.reward_error}
                    for s in samples[:NUM_SAMPLES_SHOWN]],
    }


def open_engine(args, model_folder: str):
    """The engine that generates: an `HttpEngine` on --engine-url (checked with /health), else the
    CPU engine with the model of `model_folder` loaded in this process."""
    if args.engine_url is None:
        from stacx.rollout.engines.cpu import CpuEngine

        return CpuEngine.from_hf_checkpoint(model_folder, seed=args.seed)
    from stacx.rollout.engines.registry import resolve_engine_kind
    from stacx.rollout.http_client import RetryPolicy

    try:
        kind = resolve_engine_kind(args.engine_kind or "http", flag="--engine-kind")
    except ValueError as err:
        raise EvalUsageError(str(err)) from None
    # A batch may take minutes.
    engine = kind.connect(args.engine_url, retry=RetryPolicy(timeout_s=600.0, max_attempts=2))
    if not engine.health():
        raise EvalUsageError(f"--engine-url {args.engine_url}: the server does not answer /health with 200; "
                             "start it (`stacx serve --hf-checkpoint FOLDER` or SGLang) or fix the URL")
    return engine


def generate_in_batches(manager, examples, sampling, *, n_samples: int, batch_size: int, progress_bar: bool) -> list:
    """Samples of every example, `batch_size` prompts per engine call, `group_index` = the prompt's
    index in `examples` (what `evaluation_metrics` groups by). The manager's seed counter runs on
    across calls, so the samples do not depend on batch_size under a deterministic engine."""
    from tqdm import tqdm

    samples = []
    with tqdm(total=len(examples), desc="stacx eval", unit="prompt", file=sys.stderr, disable=not progress_bar,
              dynamic_ncols=True) as bar:
        for start in range(0, len(examples), batch_size):
            batch = examples[start:start + batch_size]
            batch_samples = manager.generate([e.prompt_ids for e in batch], sampling, n_samples_per_prompt=n_samples,
                                             labels=[e.label for e in batch], metadatas=[e.metadata for e in batch])
            for sample in batch_samples:
                sample.group_index += start
            samples.extend(batch_samples)
            bar.update(len(batch))
    return samples


def write_report(report: dict, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
        handle.write("\n")


def run(args) -> int:
    from stacx.models.checkpoint import CheckpointNotFoundError
    from stacx.rollout.data import MalformedRowError
    from stacx.trainer.checkpoint import CheckpointError

    from stacx.backend_warnings import print_cpu_path_notice

    try:
        validate_args(args)
        if args.custom_module:
            from stacx.plugins.discovery import load_custom_modules

            load_custom_modules(args.custom_module, ship_to_workers=False)  # no workers: eval is one process
        if args.engine_url is None:  # the model runs here
            print_cpu_path_notice()
        report = evaluate_checkpoint(args)
    except (EvalUsageError, CheckpointNotFoundError, CheckpointError, MalformedRowError, ValueError) as err:
        print(f"stacx eval: {err}", file=sys.stderr)
        return 2
    if args.out:
        try:
            write_report(report, args.out)
        except OSError as err:  # e.g. the folder became read-only during the evaluation
            print(json.dumps(report["metrics"], indent=2))
            print(f"stacx eval: --out {args.out}: cannot write the report ({err}); the metrics are above", file=sys.stderr)
            return 1
    print(json.dumps(report["metrics"], indent=2))
    written = f"wrote {os.path.abspath(args.out)}" if args.out else "--out FILE keeps the report with its samples"
    print(f"stacx eval: {report['num_prompts']} prompts x {report['n_samples']} sample(s) of {report['checkpoint']}; "
          + written)
    return 0
