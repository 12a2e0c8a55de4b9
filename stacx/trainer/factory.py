"""Build a run: recipe, role groups (Ray workers or this torchrun job's processes), rollout, logger -> `StacxTrainer`.

    trainer = create_trainer(run_config)      # a Ray run (the role workers: stacx.trainer.cluster.ray.graph)
    trainer.run()

Several runs on one set of running role workers (a sweep, a notebook, a test module), each starting as
on fresh workers but without their process start (docs/training-loop.md, "Warm role workers"):

    graph = create_run_workers(run_config)                        # Ray connected first
    for lr in (1e-4, 3e-4):
        create_trainer(with_lr(run_config, lr), graph=graph).run()   # the graph stays open
    graph.shutdown()

The torchrun path is `stacx.trainer.spmd.build_spmd_trainer`; both share the driver-side pieces here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from stacx.objectives import import_builtin_and_custom_modules, load_custom_modules
from stacx.rollout.asynchronous.async_rollout import check_async_supported
from stacx.rollout.service import RolloutService, load_tokenizer
from stacx.trainer.batch import StepDataSource
from stacx.trainer.checkpoint import verify_start_folders
from stacx.trainer.cluster.ray.connect import connect_ray
from stacx.trainer.cluster.ray.graph import RoleWorkerGraph, WorkerLayout, check_graph_fits, create_role_workers
from stacx.trainer.cluster.ray.group import RayChannel, RayRoleGroup
from stacx.trainer.config.algorithm import infer_algorithm
from stacx.trainer.config.checks import check_agent_supported
from stacx.trainer.config.critic_modes import with_critic_as_configured
from stacx.trainer.config.mini_batches import (
    num_optimizer_steps,
    optimizer_steps_per_rollout,
    with_resolved_mini_batches,
)
from stacx.trainer.config.recipe import TrainingConfig
from stacx.trainer.config.resolve import (
    apply_run_env_overrides,
    flux_name_also_a_recipe,
    recipe_named_by_config,
    resolve_algorithm_config,
    user_algorithm_values,
)
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig, engine_lora_flags
from stacx.trainer.loop import StacxTrainer
from stacx.trainer.metrics import ROLLOUTS_FILE, MetricsLogger, keep_rows_before
from stacx.trainer.preflight import replays_trajectories
from stacx.trainer.recipes import get_recipe
from stacx.trainer.sample_sources import choose_sample_source

# ---- the whole run: recipe -> workers + runtimes + rollout + logger -> StacxTrainer ----------


def resolve_recipe(run_config: RunConfig):
    """(TrainingConfig, resolved AlgorithmConfig) of a run: custom modules imported, then infer_algorithm."""
    import_builtin_and_custom_modules()  # stacx/custom/ may hold kernels and recipes
    if run_config.train.custom_module:
        load_custom_modules(list(run_config.train.custom_module))

    estimator = user_algorithm_values(run_config).get("advantage_estimator", run_config.algorithm.advantage_estimator)
    warning = flux_name_also_a_recipe(run_config)
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=2)
    name = infer_algorithm({"algorithm": recipe_named_by_config(run_config), "use_critic": run_config.train.use_critic,
                            "advantage_estimator": estimator})
    training_config = with_critic_as_configured(get_recipe(name), run_config.model)  # --lora-critic frozen
    return training_config, resolve_algorithm_config(training_config, run_config)


def build_metrics_logger(run_config: RunConfig, recipe: str, start_step: int = 0):
    """The driver's MetricsLogger for a run of `recipe` (named in the plots' titles with the --out
    folder) that starts (or resumes) at rollout step `start_step`. Its rows, steps and progress bar
    count optimizer steps (`StacxTrainer.log`); rollouts.jsonl keeps the rows of the rollout steps
    before `start_step`."""
    section = run_config.logging
    per_rollout = optimizer_steps_per_rollout(run_config.train)
    logger = MetricsLogger(section.out, total_steps=num_optimizer_steps(run_config.train),
                           start_step=start_step * per_rollout, tensorboard=section.tensorboard,
                           wandb_project=section.wandb_project, run_config=run_config.to_dict(),
                           progress_bar=section.progress_bar, plots=section.plots, recipe=recipe,
                           optimizer_steps_per_rollout=per_rollout, expert_load=section.log_expert_load)
    if start_step and per_rollout > 1:  # the logger kept the dumps of rollout steps < start_step * per_rollout
        keep_rows_before(Path(section.out) / ROLLOUTS_FILE, start_step)
    return logger


def build_driver_side(run_config: RunConfig, training_config: TrainingConfig, *, launched=None):
    """(tokenizer, StepDataSource, RolloutService or None) for the process that drives the run;
    `launched`: the rollout servers `launch_rollout_server` started (stopped here on any failure)."""
    try:
        if run_config.model.hf_checkpoint is None:
            raise ValueError("--hf-checkpoint is not set (the model every role starts from, and its tokenizer)")
        if run_config.train.replay_rollouts:  # the batches come from the dump: no data, engine or reward
            if launched is not None:
                launched.stop()
            return None, None, None
        tokenizer = load_tokenizer(run_config.model.hf_checkpoint)
        data = StepDataSource(run_config, training_config, tokenizer)
    except BaseException:
        if launched is not None:
            launched.stop()
        raise
    rollout = None
    if training_config.data_source == "rollout" and data.kind != "trajectory":
        rollout = RolloutService.start(run_config.rollout, run_config.teacher,
                                       plan=rollout_plan(training_config, run_config),
                                       hf_checkpoint=run_config.model.hf_checkpoint, tokenizer=tokenizer,
                                       launched=launched, lora_flags=engine_lora_flags(run_config.model))
    elif launched is not None:
        launched.stop()
    return tokenizer, data, rollout


def launch_rollout_server(run_config: RunConfig, training_config: TrainingConfig):
    """The run's rollout servers that load beside the role workers (the CPU engine's `stacx serve`),
    started now without waiting for them (None when the run starts none such): they load their model
    while the role workers start, and `build_driver_side` waits for them.
    Only the process starts early; the driver itself does one thing at a time."""
    if training_config.data_source != "rollout" or replays_trajectories(run_config, training_config) \
            or run_config.train.replay_rollouts:
        return None
    return RolloutService.launch_beside_workers(run_config.rollout, hf_checkpoint=run_config.model.hf_checkpoint,
                                                lora_flags=engine_lora_flags(run_config.model))


def create_run_workers(run_config: RunConfig, *, layout: WorkerLayout | None = None):
    """Start the role workers of `run_config`'s recipe and layout, for runs given them with
    `create_trainer(..., graph=)`; the caller shuts the returned `RoleWorkerGraph` down. Ray must be
    connected (`stacx.trainer.cluster.ray.connect.connect_ray`, or `ray.init`)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("create_run_workers needs a Ray connection: call stacx.trainer.cluster.ray.connect."
                           "connect_ray(address) (or ray.init) first, and keep it while the workers are used")
    run_config = apply_run_env_overrides(run_config)
    training_config, _ = resolve_recipe(run_config)
    return create_role_workers(training_config, layout or WorkerLayout.from_parallel_section(run_config.parallel))


def create_trainer(run_config: RunConfig, *, layout: WorkerLayout | None = None, graph: RoleWorkerGraph | None = None):
    """A ready `StacxTrainer` for a Ray run: recipe, Ray, role workers with their runtimes, rollout, logger.

    `layout` overrides the worker layout derived from `run_config.parallel` (tests pin CPUs with it).
    `graph`: running role workers to train on (`create_run_workers`, `create_role_workers`) instead of
    starting the run's own: their roles and layouts must be this run's (else ValueError naming the role,
    both layouts and the fix, before anything starts); every worker is emptied and set up again first
    (`RoleWorkerGraph.prepare_run`), so the run is the one fresh workers would train, bit for bit. The
    run uses the caller's Ray connection and leaves the graph running (its models freed) when it ends;
    a failed run kills the graph's workers (a rank may be stuck in a collective) and the graph refuses
    further runs.
    On failure everything started so far is released before the error propagates.
    """
    run_config = apply_run_env_overrides(run_config)  # STACX_* read once; workers get the result
    training_config, algorithm = resolve_recipe(run_config)
    run_config = with_resolved_mini_batches(run_config, training_config.data_source)  # what every rank reads
    plan = rollout_plan(training_config, run_config)  # a bad roll-in fails before anything starts
    check_async_supported(run_config.rollout, plan, algorithm)
    check_agent_supported(run_config, training_config)
    verify_start_folders(run_config.model, training_config)  # once, here, rather than on every worker
    layout = layout or WorkerLayout.from_parallel_section(run_config.parallel)
    borrowed = graph
    if borrowed is not None:
        check_graph_fits(borrowed, training_config, layout)  # refused before a server or Ray call starts
        connection = BorrowedConnection()
    else:
        connection = connect_ray(run_config.parallel.ray_address)
    graph, rollout = None, None
    launched = launch_rollout_server(run_config, training_config)
    try:
        try:
            if borrowed is not None:
                borrowed.prepare_run(training_config, layout)
                graph = borrowed
            else:
                graph = create_role_workers(training_config, layout)
            roles = {role.name: RayRoleGroup(graph.workers[role.name], role, run_config, algorithm)
                     for role in training_config.roles}
        except BaseException:
            if launched is not None:
                launched.stop()
            raise
        _, data, rollout = build_driver_side(run_config, training_config, launched=launched)

        def close():
            if borrowed is None:
                graph.shutdown()
            else:
                graph.release_run()
            connection.shutdown()

        def fail():
            graph.kill("killed after a failed run")
            connection.shutdown()

        samples = choose_sample_source(run_config=run_config, training_config=training_config, algorithm=algorithm,
                                       data=data, rollout=rollout, is_driver=True)  # a Ray run's driver
        return StacxTrainer(run_config=run_config, training_config=training_config, algorithm=algorithm,
                            roles=roles, channel=RayChannel(), data=data, rollout=rollout, sample_source=samples,
                            make_metrics_logger=lambda start_step: build_metrics_logger(
                                run_config, training_config.name, start_step),
                            on_failure=fail, on_close=close, exchanges=graph.exchanges)
    except BaseException:
        try:
            if graph is not None:
                graph.kill("killed after a failed run")
            if rollout is not None:
                rollout.close()
        finally:
            connection.shutdown()
        raise


class BorrowedConnection:
    """The Ray connection of a run on a caller's graph: the caller's, left open when the run ends."""

    def shutdown(self) -> None:
        pass
