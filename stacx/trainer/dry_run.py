"""What `stacx train --dry-run` prints for a text recipe (`TextDriver.describe`): the recipe, its role graph,
each role's placement, where it would run, and the settings the recipe reads; starts nothing."""

from __future__ import annotations

import os

import yaml

from stacx.trainer.cluster.ray.connect import resolve_ray_address
from stacx.trainer.cluster.ray.graph import WorkerLayout, resolve_role_layouts
from stacx.trainer.config.mini_batches import optimizer_steps_per_rollout, with_resolved_mini_batches
from stacx.trainer.config.recipe import ALGORITHM_LINE_PREFIX, algorithm_line
from stacx.trainer.config.relevance import settings_the_recipe_reads
from stacx.trainer.config.resolve import resolve_algorithm_config, resolved_run_config_dict
from stacx.trainer.spmd import launched_by_torchrun


def describe_run(run_config, recipe, environ=None) -> str:
    """What `--dry-run` prints: the recipe, its role graph, each role's (tp, cp, dp) placement,
    where it would run, and the resolved run configuration as YAML."""
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
