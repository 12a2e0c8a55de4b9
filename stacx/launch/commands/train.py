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

from stacx.launch.workloads import discover_workloads

HELP = "train with a recipe (RL, distillation, SFT, DPO); flags or --config run.yaml, --dry-run to inspect"


def add_arguments(parser) -> None:
    from stacx.launch.run_flags import add_run_config_arguments

    add_run_config_arguments(parser)


def describe_run(run_config, recipe, environ=None) -> str:
    """What `--dry-run` prints: the recipe, its role graph, each role's (tp, cp, dp) placement,
    where it would run, and the resolved run configuration as YAML."""
    import yaml

    from stacx.trainer.cluster.ray.graph import WorkerLayout, resolve_role_layouts
    from stacx.trainer.cluster.ray.connect import resolve_ray_address
    from stacx.trainer.config.recipe import ALGORITHM_LINE_PREFIX, algorithm_line
    from stacx.trainer.config.relevance import settings_the_recipe_reads
    from stacx.trainer.config.mini_batches import optimizer_steps_per_rollout, with_resolved_mini_batches
    from stacx.trainer.config.resolve import resolve_algorithm_config, resolved_run_config_dict
    from stacx.trainer.spmd import launched_by_torchrun

    environ = os.environ if environ is None else environ
    parallel = run_config.parallel
    layouts = resolve_role_layouts(recipe, WorkerLayout.from_parallel_section(parallel))
    graph = recipe.role_graph()
    algorithm = resolve_algorithm_config(recipe, run_config)
    # The recipe's summary line shows its defaults; the run's resolved settings replace it so that
    # the header and the resolved config below agree (e.g. --use-kl-loss on a recipe without KL).
    header = [algorithm_line(algorithm, recipe.roles) if line.startswith(ALGORITHM_LINE_PREFIX) else line
              for line in recipe.describe().splitlines()]
    # The recipe says where a reference would come from; the run says whether one is given.
    for role in recipe.roles:
        if role.reference_checkpoint_arg and getattr(run_config.model, role.reference_checkpoint_arg, None) is None:
            flag = "--" + role.reference_checkpoint_arg.replace("_", "-")
            header = [line.replace(f"in-worker reference from {flag}", f"no in-worker reference ({flag} not set)")
                      if line.startswith(f"    {role.name} [") else line for line in header]
    lines = [*header, "", "role graph:"]
    for pool, members in graph.pools.items():
        lines.append(f"  pool {pool}: {', '.join(members)}")
    if graph.inject_order:
        lines.append(f"  inject order: {' -> '.join(graph.inject_order)}")
    lines += ["", "placement:"]
    for pool, members in graph.pools.items():
        num_bundles = max(layouts[name].world_size for name in members)
        lines.append(f"  pool {pool}: {num_bundles} bundle(s) x ({parallel.num_cpus_per_rank:g} CPU, "
                     f"{parallel.num_gpus_per_rank:g} GPU)" + (f", shared by {len(members)} roles" if len(members) > 1 else ""))
        for name in members:
            layout = layouts[name]
            lines.append(f"    {name}: {layout.describe()} -> {layout.world_size} rank(s)")
    if launched_by_torchrun(environ):
        where = f"torchrun SPMD, world size {environ.get('WORLD_SIZE', '?')} (no Ray)"
    else:
        address = resolve_ray_address(parallel.ray_address, environ)
        where = f"Ray cluster at {address}" if address else "a local Ray cluster started by the driver"
    # The derived one of --global-batch-size / --num-steps-per-rollout as the run will use it, never `null`.
    run_config = with_resolved_mini_batches(run_config, recipe.data_source)
    per_rollout = optimizer_steps_per_rollout(run_config.train)
    if per_rollout > 1:
        lines += ["", f"mini-batches: {per_rollout} optimizer steps per rollout ({run_config.train.num_steps} rollouts, "
                      f"{run_config.train.num_steps * per_rollout} optimizer steps; --global-batch-size "
                      f"{run_config.train.global_batch_size} x --num-steps-per-rollout "
                      f"{run_config.train.num_steps_per_rollout} x --num-epochs {run_config.train.num_epochs})"]
    resolved = resolved_run_config_dict(run_config, algorithm, recipe=recipe.name)
    shown, left_out = settings_the_recipe_reads(resolved, recipe, algorithm, run_config.given_keys)
    lines += ["", f"runs on: {where}", "",
              f"resolved run config: the settings recipe {recipe.name} reads (algorithm: its defaults under your settings;"
              f" {left_out} settings it does not read are left out, every setting you gave is shown):",
              yaml.safe_dump(shown, sort_keys=False, default_flow_style=False).rstrip()]
    return "\n".join(lines)


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
    """`stacx train` for a recipe of a registered workload (not 'text'): its driver checks the configuration
    (exit status 2 with the message), prints it for --dry-run, or trains."""
    try:
        driver = workload.driver(run_config, recipe)
    except ValueError as err:
        report_config_error(f"stacx train: {err}")
        return 2
    if run_config.train.dry_run:
        print(driver.describe())
        return 0
    driver.run()
    return 0


def run(args) -> int:
    from stacx.trainer.lifetime import end_with_launcher, launched_by_torchrun  # light: the standard library

    if launched_by_torchrun():  # first: the launcher is known only while it is this rank's parent
        end_with_launcher()
    from stacx.launch.run_flags import resume_overrides, run_config_from_args
    from stacx.trainer.config.checks import fit_response_length_to_context
    from stacx.trainer.config.recipe import RecipeError
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.preflight import ignored_settings, run_preflight, unread_checkpoint_flags
    from stacx.trainer.restarts import elastic_restart_config
    from stacx.trainer.resume_checks import check_resume
    from stacx.trainer.config.run import ConfigError
    from stacx.trainer.config.workload import TEXT_MODALITY, get_workload

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
        recipe, algorithm = resolve_recipe(run_config)  # also checks the algorithm settings against the recipe
        if recipe.modality != TEXT_MODALITY:  # a registered workload's own driver loop
            return run_workload(get_workload(recipe.modality), run_config, recipe)
        run_preflight(run_config, recipe, algorithm)  # the same checks for --dry-run and the run itself
        if os.environ.get("RANK", "0") == "0":
            for message in [*unread_checkpoint_flags(run_config, recipe).values(), *ignored_settings(run_config)]:
                print(f"stacx train: warning: {message}", file=sys.stderr)
        if run_config.train.dry_run:
            print(describe_run(run_config, recipe))
            return 0
    except (ConfigError, RecipeError, ValueError) as err:
        report_config_error(f"stacx train: {err}")
        return 2
    from stacx.trainer import run_training
    from stacx.trainer.interrupts import RunInterrupted, stop_on_termination_signals
    from stacx.trainer.checkpoint import CheckpointError
    from stacx.trainer.numerics import NonFiniteError
    from stacx.trainer.save_lock import SaveFolderInUse
    from stacx.trainer.run_summary import describe_run_outputs, unsaved_model_warning

    from stacx.backend_warnings import print_cpu_path_notice

    print_cpu_path_notice()
    is_first_rank = os.environ.get("RANK", "0") == "0"  # under torchrun every rank runs this command
    warning = unsaved_model_warning(run_config)
    if warning and is_first_rank:
        print(f"stacx train: warning: {warning}", file=sys.stderr)
    started = time.monotonic()
    with stop_on_termination_signals():
        try:
            run_training(run_config)
        except RunInterrupted as err:  # the same two lines and exit status under torchrun (rank 0) and Ray
            if is_first_rank:
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
    if is_first_rank:
        print(describe_run_outputs(run_config, seconds=time.monotonic() - started))
    return 0
