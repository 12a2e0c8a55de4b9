"""Recipes, the factory, Ray role workers, the training loop and checkpoints.

    from stacx.trainer import run_training
    run_training(run_config)          # torchrun job -> run_spmd, else a Ray run via create_trainer

Submodules import their heavy dependencies (Ray, megatron-core) where they use them.
"""

import os

from stacx.lazy_names import lazy_names


def run_training(run_config, *, graph=None) -> dict:
    """Train with the right launcher: SPMD under torchrun, Ray otherwise. Returns the last metrics.

    `builtin:<task>` data (stacx.tasks) is resolved to files here, so Python callers get it too.
    `graph`: running Ray role workers to train on (`create_trainer(..., graph=)`; several runs on one set of
    workers); not under torchrun, nor with --max-restarts (a failed run kills the graph's workers).
    """
    # Imported here: `import stacx.trainer` stays light (no Ray, megatron-core or loop until a run starts).
    from stacx.tasks.data import resolve_builtin_data
    from stacx.trainer.config.checks import fit_response_length_to_context
    from stacx.trainer.lifetime import end_with_launcher
    from stacx.trainer.restarts import ELASTIC_RESTART_WAIT_S, elastic_restart_config, elastic_restart_count
    from stacx.trainer.save_lock import hold_save_folder
    from stacx.trainer.spmd import launched_by_torchrun

    run_config = fit_response_length_to_context(resolve_builtin_data(run_config))
    torchrun = launched_by_torchrun()
    if graph is not None and (torchrun or run_config.train.max_restarts):
        raise ValueError("run_training(graph=...): running role workers serve a Ray run without --max-restarts "
                         "(a failed run kills them, so a restart would have none); "
                         + ("under torchrun there are no role workers to give" if torchrun
                            else "set --max-restarts 0 or leave graph= out"))
    if torchrun:
        end_with_launcher()  # a SIGKILLed torchrun must not leave this rank training (stacx.trainer.lifetime)
        run_config = elastic_restart_config(run_config)  # a torch elastic restart resumes the newest checkpoint
    # One writer per --save folder: the driver (torchrun: rank 0) holds its lock until the run has ended
    # (a Ray driver across its --max-restarts; a restarted rank 0 waits for the dead one's to be dropped).
    is_driver = not torchrun or os.environ.get("RANK", "0") == "0"
    wait_s = ELASTIC_RESTART_WAIT_S if torchrun and elastic_restart_count() else 0.0
    with hold_save_folder(run_config.model.save if is_driver else None, wait_s=wait_s):
        return _build_and_run(run_config, torchrun, graph)


def _build_and_run(run_config, torchrun: bool, graph=None) -> dict:
    # Imported here: `import stacx.trainer` stays light (no Ray, megatron-core or loop until a run starts).
    from stacx.trainer.heartbeat import Heartbeat
    from stacx.trainer.restarts import RESTARTS_METRIC, elastic_restart_count, install_fault_hook, run_with_restarts
    from stacx.trainer.spmd import build_spmd_trainer

    if torchrun:
        with Heartbeat("starting", "the process group, this rank's model and the rollout engine",
                       enabled=os.environ.get("RANK", "0") == "0"):
            trainer = build_spmd_trainer(run_config)
        if run_config.train.max_restarts:
            trainer.run_counters[RESTARTS_METRIC] = float(elastic_restart_count())
        install_fault_hook(trainer, generation=elastic_restart_count(), torchrun=True)
        return trainer.run()
    # Imported here: Ray and the role workers load only for a Ray run (start-up time).
    from stacx.trainer.factory import create_trainer

    def build(config):
        with Heartbeat("starting", "Ray, the role workers and their models, the rollout engine"):
            return create_trainer(config, graph=graph)

    return run_with_restarts(run_config, build)


# Lazy exports: `from stacx.trainer import StacxTrainer` without importing Ray at package import.
_EXPORTS = {
    "stacx.trainer.loop": ("StacxTrainer",),
    "stacx.trainer.factory": ("create_trainer",),
    "stacx.trainer.spmd": ("run_spmd",),
    "stacx.trainer.runtime": ("RoleRuntime",),
    "stacx.rollout.service": ("RolloutService",),
}
_, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())

__all__ = ["RoleRuntime", "RolloutService", "StacxTrainer", "create_trainer", "run_spmd", "run_training"]
