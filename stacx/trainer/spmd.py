"""torchrun SPMD training for recipes with one role (sft, dpo, the GRPO family, opd with an external teacher).

    torchrun --nnodes N --nproc-per-node G -m stacx.train --algorithm sft --hf-checkpoint ... 

Every process is one rank of the recipe's one role (RANK / WORLD_SIZE / MASTER_ADDR from
torchrun); the role's (tp, cp) come from the run's parallel section and dp = world / (tp * cp).
Rank 0 drives: it reads the data, talks to the rollout engine and the teacher, logs and commits
checkpoints; the step's samples are broadcast to every rank. The loop is the same
`StacxTrainer` as a Ray run, with `LocalRoleGroup` / `TorchrunChannel` in place of Ray workers,
and the checkpoints have the same format.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from stacx.parallel.groups import destroy_parallel_layout, init_distributed_from_env, initialize_parallel_layout
from stacx.rollout.asynchronous.async_rollout import check_async_supported
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.trainer.checkpoint import verify_start_folders
from stacx.trainer.cluster.local import LocalRoleGroup, TorchrunChannel
from stacx.parallel.node_interface import bind_collectives_to_node, local_address_toward
from stacx.trainer.config.checks import check_agent_supported
from stacx.trainer.config.mini_batches import with_resolved_mini_batches
from stacx.trainer.config.resolve import apply_run_env_overrides
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.factory import build_driver_side, build_metrics_logger, launch_rollout_server, resolve_recipe
from stacx.trainer.lifetime import TORCHRUN_ENV, launched_by_torchrun  # noqa: F401 (this module's names too)
from stacx.trainer.loop import StacxTrainer
from stacx.trainer.runtime.role_runtime import RoleRuntime
from stacx.trainer.sample_sources import choose_sample_source



def build_spmd_trainer(run_config: RunConfig):
    """Initialize torch.distributed from the environment and build this rank's StacxTrainer."""
    run_config = apply_run_env_overrides(run_config)  # STACX_* read once, as on the Ray path
    training_config, algorithm = resolve_recipe(run_config)
    run_config = with_resolved_mini_batches(run_config, training_config.data_source)  # what every rank reads
    if len(training_config.roles) != 1:
        raise ValueError(f"recipe {training_config.name!r} has roles {[r.name for r in training_config.roles]}; "
                         "torchrun runs recipes with one role (sft, dpo, grpo and its family, opd, ...); launch recipes with "
                         "several roles on Ray (stacx train without torchrun)")
    plan = rollout_plan(training_config, run_config)  # a bad roll-in fails before anything starts
    check_async_supported(run_config.rollout, plan, algorithm, torchrun=True,
                          engine_kind=resolve_engine_kind(run_config.rollout.rollout_engine).name)
    check_agent_supported(run_config, training_config)
    verify_start_folders(run_config.model, training_config)
    parallel = run_config.parallel
    if "MASTER_ADDR" in os.environ:  # gloo/NCCL listen on the interface toward the master, not the host name's
        bind_collectives_to_node(local_address_toward(os.environ["MASTER_ADDR"]))
    init_distributed_from_env(parallel.collective_timeout_s)
    groups = initialize_parallel_layout(parallel.tensor_model_parallel_size, parallel.context_parallel_size,
                                        expert_model_parallel_size=parallel.expert_model_parallel_size,
                                        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
                                        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
                                        timeout_s=parallel.collective_timeout_s)
    role = training_config.roles[0]
    channel = TorchrunChannel()
    data, rollout = None, None
    # The driver rank starts its rollout server's process first: it loads while this rank builds its model.
    launched = launch_rollout_server(run_config, training_config) if channel.is_driver else None
    try:
        runtime = RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                              train=run_config.train, rank=dist.get_rank())
    except BaseException:
        if launched is not None:
            launched.stop()
        raise
    if channel.is_driver:
        _, data, rollout = build_driver_side(run_config, training_config, launched=launched)

    def close():
        runtime.close()

        destroy_parallel_layout()

    samples = choose_sample_source(run_config=run_config, training_config=training_config, algorithm=algorithm,
                                   data=data, rollout=rollout, is_driver=channel.is_driver)
    return StacxTrainer(run_config=run_config, training_config=training_config, algorithm=algorithm,
                        roles={role.name: LocalRoleGroup(runtime, role.name)}, channel=channel, data=data,
                        rollout=rollout, sample_source=samples, on_failure=runtime.close, on_close=close, close_engine_clients=runtime.close,
                        make_metrics_logger=lambda start_step: build_metrics_logger(run_config, training_config.name,
                                                                                   start_step))


def run_spmd(run_config: RunConfig) -> dict:
    """Train this torchrun rank to the end; returns the last step's metrics (the same on every rank)."""
    return build_spmd_trainer(run_config).run()
