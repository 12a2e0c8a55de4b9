"""The core's `text` workload: the driver and per-rank runtime that `stacx.trainer.config.workload` names
(`TEXT_WORKLOAD`) for LLM recipes, as `stacx.diffusion.workload` gives the `image` workload's.

`stacx train` launches a text recipe as it launches every registered workload (`run_workload`): it builds
the driver (the preflight checks: a `ConfigError` naming the flag), prints `describe()` for `--dry-run`,
or calls `run()`."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def is_first_rank(environ=None) -> bool:
    """Rank 0, or a process outside torchrun (under torchrun every rank runs `stacx train`)."""
    environ = os.environ if environ is None else environ
    return environ.get("RANK", "0") == "0"


class TextDriver:
    """One run of a text recipe: `run_training` (SPMD under torchrun, Ray role workers otherwise)."""

    def __init__(self, run_config, recipe):
        """Checks the run as `run_training` will start it (the preflight: the same checks for --dry-run and
        the run itself) and warns, on the first rank, about flags the recipe will not read."""
        # Imported here: a role worker imports this module for `text_runtime` and never runs the preflight.
        from stacx.trainer.config.resolve import resolve_algorithm_config
        from stacx.trainer.preflight import ignored_settings, run_preflight, unread_checkpoint_flags

        self.run_config = run_config
        self.recipe = recipe
        # The data (its tokenizer: `transformers`, seconds of start-up) is read and checked by the first rank
        # only: under torchrun it alone drives the run, and its failure stops the other ranks.
        run_preflight(run_config, recipe, resolve_algorithm_config(recipe, run_config), load_data=is_first_rank())
        if is_first_rank():
            for message in [*unread_checkpoint_flags(run_config, recipe).values(), *ignored_settings(run_config)]:
                print(f"stacx train: warning: {message}", file=sys.stderr)

    def describe(self) -> str:
        """What `stacx train --dry-run` prints: the recipe, its role graph, the placement and the settings."""
        # Imported here: only --dry-run prints it (YAML, Ray's placement helpers: start-up time).
        from stacx.trainer.dry_run import describe_run

        return describe_run(self.run_config, self.recipe)

    def run(self) -> dict[str, Any]:
        """Train; SIGINT / SIGTERM end the run with `RunInterrupted` once its workers and servers are stopped."""
        # Imported here: `run_training` pulls in the loop, Ray and megatron-core (start-up time).
        from stacx.backend_warnings import print_cpu_path_notice
        from stacx.trainer import run_training
        from stacx.trainer.interrupts import stop_on_termination_signals
        from stacx.trainer.run_summary import describe_run_outputs, unsaved_model_warning

        print_cpu_path_notice()
        warning = unsaved_model_warning(self.run_config)
        if warning and is_first_rank():
            print(f"stacx train: warning: {warning}", file=sys.stderr)
        started = time.monotonic()
        with stop_on_termination_signals():
            metrics = run_training(self.run_config)
        if is_first_rank():
            print(describe_run_outputs(self.run_config, seconds=time.monotonic() - started))
        return metrics


def text_runtime(role, run_config, algorithm, groups, *, rank: int):
    """One rank's `RoleRuntime` of `role`, as a role worker builds it."""
    # Imported here: the runtime imports megatron-core (start-up time).
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    return RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                       train=run_config.train, rank=rank)
