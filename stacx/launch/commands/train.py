"""`stacx train` (also `python -m stacx.train`, the form torchrun and `ray job submit` use).

    stacx train --algorithm grpo --hf-checkpoint ckpt/ --prompt-data builtin:addition --num-steps 20
    stacx train --config examples/configs/grpo.yaml --lr 1e-4        # flags override the file
    stacx train --config run.yaml --dry-run                          # recipe, roles, placement; no workers
    stacx train --load runs/x                                        # resume with the saved run config
    stacx train --load runs/x --num-steps 40                         # ... and a flag overriding it (printed)

Flags are generated from the run configuration (stacx/trainer/config/run.py): one per field,
see `stacx train --help`. Under torchrun single-role recipes run SPMD in the
launched processes; otherwise role workers run on Ray (`--ray-address`, RAY_ADDRESS, or a
local cluster). The runtime picks; this command only resolves the configuration.
"""

from __future__ import annotations

import os
import sys
import time

from stacx.launch.session_front import install_session_front
from stacx.launch.workloads import discover_workloads

HELP = "train with a recipe (RL, distillation, SFT, DPO); flags or --config run.yaml, --dry-run to inspect"


def add_arguments(parser) -> None:
    from stacx.launch.run_flags import add_run_config_arguments

    add_run_config_arguments(parser)


def report_config_error(message: str, environ=None) -> None:
    """Print a refused setting once. Under torchrun every rank refuses the same config: rank 0 prints it,
    and each rank writes it to torchrun's error file, so torchrun's failure summary ends with the
    message instead of "To enable traceback see ..."."""
    environ = os.environ if environ is None else environ
    if environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)
    error_file = environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import json  # only under torchrun

        record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                "timestamp": str(int(time.time()))}}}
        with open(error_file, "w") as handle:
            json.dump(record, handle)


def resume_hint(run_config) -> str:
    """What an interrupted run can do next: resume from its newest complete checkpoint, if it saved one."""
    from stacx.trainer.checkpoint import latest_checkpoint

    save = run_config.model.save
    latest = latest_checkpoint(save) if save else None
    if latest is None:
        return ("no checkpoint was saved" + (f" under --save {save}" if save else " (no --save)")
                + ", so a new run starts from the beginning")
    return f"resume with the same command plus --load {save} (its newest complete checkpoint is {latest})"


def run_workload(workload, run_config, recipe) -> int:
    """`stacx train` for a recipe of any registered workload, the core's `text` included: its driver checks the
    configuration (exit status 2 with the message), prints it for --dry-run, or trains. A run that ends early
    says why: stopped by a signal (`RunInterrupted`: its exit status, and how to resume), non-finite steps
    (1), a --save folder taken after the checks (2), a start checkpoint that no longer loads (1)."""
    install_session_front()  # the recorder an agent run on vLLM starts in front of it (stacx.launch.session_front)
    try:
        driver = workload.driver(run_config, recipe)
        if run_config.train.dry_run:
            print(driver.describe())
            return 0
    except ValueError as err:
        report_config_error(f"stacx train: {err}")
        return 2
    from stacx.trainer.interrupts import RunInterrupted
    from stacx.trainer.checkpoint import CheckpointError
    from stacx.trainer.numerics import NonFiniteError
    from stacx.trainer.save_lock import SaveFolderInUse

    try:
        driver.run()
    except RunInterrupted as err:  # the same two lines and exit status under torchrun (rank 0) and Ray
        if os.environ.get("RANK", "0") == "0":
            print(f"stacx train: stopped by {err.signal_name}; the run's workers and servers were stopped",
                  file=sys.stderr)
            print(f"stacx train: {resume_hint(run_config)}", file=sys.stderr)
        return err.exit_code
    except NonFiniteError as err:
        print(f"stacx train: {err}", file=sys.stderr)
        return 1
    except SaveFolderInUse as err:  # taken between the preflight's look and the run's start
        report_config_error(f"stacx train: {err}")
        return 2
    except CheckpointError as err:  # e.g. a start folder whose hashes no longer match its manifest
        report_config_error(f"stacx train: {err}")
        return 1
    return 0


def run(args) -> int:
    from stacx.trainer.lifetime import end_with_launcher, launched_by_torchrun  # light: the standard library

    if launched_by_torchrun():  # first: the launcher is known only while it is this rank's parent
        end_with_launcher()
    from stacx.launch.run_flags import resume_overrides, run_config_from_args
    from stacx.trainer.config.checks import fit_response_length_to_context
    from stacx.trainer.config.recipe import RecipeError
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.restarts import elastic_restart_config
    from stacx.trainer.resume_checks import check_resume
    from stacx.trainer.config.run import ConfigError
    from stacx.trainer.config.workload import get_workload

    discover_workloads()  # the recipes of every workload, before the run's recipe is looked up
    try:
        run_config = run_config_from_args(args)
        if os.environ.get("RANK", "0") == "0":
            for line in resume_overrides(args, run_config):
                print(f"stacx train: {line} overrides the run config saved with --load {args.load}", file=sys.stderr)
        run_config = fit_response_length_to_context(run_config)  # run_training does the same
        if launched_by_torchrun():  # a rank torch elastic restarted resumes the newest checkpoint (--max-restarts)
            run_config = elastic_restart_config(run_config)
        check_resume(run_config)  # before the recipe's resolution, which splits the rollout into mini-batches
        recipe, _ = resolve_recipe(run_config)  # also checks the algorithm settings against the recipe
        workload = get_workload(recipe.modality)
    except (ConfigError, RecipeError, ValueError) as err:
        report_config_error(f"stacx train: {err}")
        return 2
    return run_workload(workload, run_config, recipe)
