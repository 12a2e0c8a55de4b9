"""`stacx tasks swe`: write SWE tasks as prompt rows (JSONL) for `stacx train --prompt-data`.

    stacx tasks swe --out swe.jsonl                           the 30 built-in tasks, `swe` environment rows
    stacx tasks swe --out swe.jsonl --tasks-file rows.jsonl   your SWE task rows (docs/agents.md, "Row format")
    stacx tasks swe --out swe.jsonl --format patch            single-turn rows for the `swe_tests` reward

Environment rows need `--custom-module stacx.tasks.swe.environment` in the run (it registers `swe`);
patch rows need `--reward-fn stacx.tasks.swe.reward:swe_tests_reward`.
"""

from __future__ import annotations

import json
import sys

HELP = "write task datasets as prompt rows: `stacx tasks swe --out FILE` (SWE bug-fix tasks)"


def add_arguments(parser) -> None:
    parser.add_argument("kind", choices=["swe"], help="the task family to write")
    parser.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write (folders are created)")
    parser.add_argument("--format", choices=["environment", "patch"], default="environment",
                        help="'environment': multi-turn rows for the `swe` environment (tools in a sandbox); "
                             "'patch': one-turn rows whose answer is a diff, for the swe_tests reward "
                             "(default: %(default)s)")
    parser.add_argument("--tasks-file", metavar="JSONL", default=None,
                        help="SWE task rows to write instead of the built-in tasks")
    parser.add_argument("--instance", action="append", default=[], metavar="ID",
                        help="keep only this instance_id (repeatable; default: every task)")
    parser.add_argument("--max-turns", type=int, default=None,
                        help="model replies per episode, environment rows (default: 20)")
    parser.add_argument("--partial-credit", action="store_true",
                        help="environment rows: an unresolved submit earns the fraction of listed tests that passed")
    parser.add_argument("--sandbox-backend", default=None, metavar="NAME",
                        help="sandbox.backend of the rows: namespace (default), bubblewrap or remote")
    parser.add_argument("--sandbox-remote-url", default=None, metavar="URL",
                        help="sandbox.remote_url, for --sandbox-backend remote")
    parser.add_argument("--sandbox-read-only-path", action="append", default=[], metavar="DIR",
                        help="sandbox.read_only_paths entry (repeatable): a host folder the commands may read")


def _sandbox_setting(args) -> dict:
    """The rows' `sandbox` mapping, checked now so that a bad value fails here, naming the flag."""
    from stacx.sandbox import SandboxConfig  # Imported here: `stacx --help` stays fast.

    setting = {}
    if args.sandbox_backend:
        setting["backend"] = args.sandbox_backend
    if args.sandbox_remote_url:
        setting["remote_url"] = args.sandbox_remote_url
    if args.sandbox_read_only_path:
        setting["read_only_paths"] = list(args.sandbox_read_only_path)
    try:
        SandboxConfig.from_dict(setting)
    except ValueError as error:
        raise SystemExit(f"stacx tasks swe: --sandbox-* flags: {error}") from None
    return setting


def _read_tasks(path: str) -> list:
    from stacx.tasks.swe import SweTask  # Imported here: `stacx --help` stays fast.

    tasks = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                tasks.append(SweTask.from_row(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as error:
                raise SystemExit(f"stacx tasks swe: --tasks-file {path}:{number}: {error}") from None
    return tasks


def run(args) -> int:
    # Imported here: `stacx --help` stays fast.
    from stacx.tasks.data import write_rows
    from stacx.tasks.swe import builtin_swe_tasks, swe_environment_rows, swe_prompt_rows
    from stacx.tasks.swe.prompts import DEFAULT_MAX_TURNS

    tasks = _read_tasks(args.tasks_file) if args.tasks_file else list(builtin_swe_tasks())
    if args.instance:
        known = {task.instance_id for task in tasks}
        unknown = [name for name in args.instance if name not in known]
        if unknown:
            raise SystemExit(f"stacx tasks swe: --instance {', '.join(unknown)}: no such task; known: "
                             f"{', '.join(sorted(known))}")
        tasks = [task for task in tasks if task.instance_id in args.instance]
    sandbox = _sandbox_setting(args)
    if args.format == "patch":
        if args.max_turns is not None or args.partial_credit:
            raise SystemExit("stacx tasks swe: --max-turns and --partial-credit apply to --format environment only")
        rows = swe_prompt_rows(tasks, sandbox=sandbox or None)
    else:
        max_turns = DEFAULT_MAX_TURNS if args.max_turns is None else args.max_turns
        if max_turns < 1:
            raise SystemExit(f"stacx tasks swe: --max-turns must be >= 1, got {max_turns}")
        rows = swe_environment_rows(tasks, max_turns=max_turns, sandbox=sandbox or None,
                                    partial_credit=args.partial_credit)
    write_rows(rows, args.out)
    print(f"wrote {len(rows)} SWE {args.format} rows to {args.out}", file=sys.stderr)
    return 0
