"""--max-restarts N: a run whose role worker, rank or Ray actor dies restarts from the newest complete
checkpoint in --save, up to N times, and says so (a line on stderr, the `run/restarts` metric).

    run_with_restarts(run_config, create_trainer)    # a Ray run: the driver rebuilds the role groups
    run_config = elastic_restart_config(run_config)  # a torchrun rank that torch elastic restarted

On Ray the driver catches the death (`RoleWorkerDied` names the role and rank, `RoleWorkerTimeout` a rank
that stopped answering); the failed trainer has already killed its workers and closed its rollout service,
so the driver builds everything again with `--load` set to the newest checkpoint and trains on. The driver
holds the --save lock (stacx.trainer.save_lock) across the restarts: the folder is never free for another
run in between, and the dead generation's workers are killed before the next one starts.

Under torchrun, torch elastic restarts the ranks (`stacx torchrun` hands the run's --max-restarts to it); a
restarted rank sees TORCHELASTIC_RESTART_COUNT > 0 and loads the newest checkpoint itself. Rank 0 takes the
--save lock again once the dead rank 0 has released it (the kernel drops it when that process ends).

What is not restarted: an error a worker raised (a bug or a bad setting raises again), a worker that died in
its own start (the same), a NaN, a refused checkpoint, Ctrl-C. Without a checkpoint yet, the run restarts
from where it started (its --load, or the beginning).

Test-only fault hook: STACX_FAULT_KILL_AT_STEP=K kills rank STACX_FAULT_KILL_RANK (default 0) of the first
trainable role with SIGKILL right after rollout step K is logged and saved, in the first generation only
(Ray: the driver kills the worker actor; torchrun: that rank kills itself). It exists for the restart tests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from stacx.trainer.checkpoint import list_checkpoints
from stacx.trainer.cluster.ray.health import RoleWorkerDied, RoleWorkerTimeout
from stacx.trainer.config.run import RunConfig

logger = logging.getLogger(__name__)

RESTARTS_METRIC = "run/restarts"
"""Restarts done before a metrics row's step (logged in every row of a run with --max-restarts > 0)."""
ELASTIC_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torch elastic's count of the restarts of this worker group (0 on the first start)."""
ELASTIC_RESTART_WAIT_S = 120.0
"""How long a restarted torchrun rank 0 waits for the dead rank 0's --save lock to be dropped."""
FAULT_KILL_AT_STEP_ENV = "STACX_FAULT_KILL_AT_STEP"
"""Test-only: kill a rank right after this rollout step (see the module doc)."""
FAULT_KILL_RANK_ENV = "STACX_FAULT_KILL_RANK"
"""Test-only: which rank of the first trainable role the fault hook kills (default 0)."""


def is_restartable(err: BaseException) -> bool:
    """A death or a hang of a worker (what a restart can cure), not an error the run's own code raised."""
    if isinstance(err, RoleWorkerTimeout):
        return True
    if isinstance(err, RoleWorkerDied):
        return "creation task" not in str(err)  # died in its own start: the same start fails again
    try:  # Imported here: Ray is slow to import (start-up time); a torchrun run may not have it.
        from ray.exceptions import ActorDiedError, RayActorError, WorkerCrashedError
    except ImportError:
        return False
    return isinstance(err, (RayActorError, ActorDiedError, WorkerCrashedError))


def describe_cause(err: BaseException) -> str:
    """The cause of a restart in one line: the worker named by the error, and the first line of its text."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return first if len(first) <= 300 else first[:297] + "..."


class ResumePoint:
    """Which checkpoint a restart loads: the newest complete one in --save this run wrote or resumed.

    A run started with --overwrite and no --load leaves the older run's checkpoints in the folder until its
    own first save; they are never taken (`foreign`), and a restart before that save starts over."""

    def __init__(self, run_config: RunConfig):
        self.run_config = run_config
        model = run_config.model
        self.foreign = ({path for _, path in list_checkpoints(model.save)}
                        if model.save and model.overwrite and not model.load else set())

    def newest(self) -> Optional[str]:
        save = self.run_config.model.save
        if not save:
            return None
        own = [path for _, path in list_checkpoints(save) if path not in self.foreign]
        return own[-1] if own else None

    def restart_config(self) -> RunConfig:
        """The run config of the next generation: --load the newest checkpoint, else the original start."""
        newest = self.newest()
        if newest is None:
            return self.run_config
        return dataclasses.replace(self.run_config, model=dataclasses.replace(self.run_config.model, load=newest))


def announce(line: str) -> None:
    logger.warning(line)
    print(f"stacx train: {line}", file=sys.stderr, flush=True)


def run_with_restarts(run_config: RunConfig, build: Callable[[RunConfig], Any]) -> dict:
    """Build and run a trainer (a Ray run); on a restartable failure build it again from the newest
    checkpoint, up to --max-restarts times. Returns the last metrics; the last failure propagates."""
    max_restarts = run_config.train.max_restarts
    resume_point = ResumePoint(run_config)
    current, restarts = run_config, 0
    while True:
        try:
            trainer = build(current)
            if max_restarts:
                trainer.run_counters[RESTARTS_METRIC] = float(restarts)
            install_fault_hook(trainer, generation=restarts, torchrun=False)
            return trainer.run()
        except Exception as err:  # noqa: BLE001 - re-raised unless it is a death a restart can cure
            if restarts >= max_restarts or not is_restartable(err):
                raise
            restarts += 1
            current = resume_point.restart_config()
            start = f"checkpoint {current.model.load}" if current.model.load else "the start"
            announce(f"restart {restarts} of --max-restarts {max_restarts} from {start}, after: {describe_cause(err)}")


def elastic_restart_count(environ=None) -> int:
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get(ELASTIC_RESTART_ENV, "0"))
    except ValueError:
        return 0


def launcher_started_at() -> float:
    """When this rank's parent (torchrun's agent) started: checkpoints older than it are another run's."""
    import psutil  # Imported here: only a restarted torchrun rank needs it.

    try:
        return psutil.Process(os.getppid()).create_time()
    except psutil.Error:
        return 0.0


def elastic_restart_config(run_config: RunConfig, environ=None) -> RunConfig:
    """A torchrun rank's run config: on a torch elastic restart, --load the newest checkpoint in --save that
    this launch wrote (or resumed), and log the restart; unchanged on the first start."""
    restarts = elastic_restart_count(environ)
    if restarts == 0 or not run_config.model.save:
        return run_config
    model = run_config.model
    own = [path for _, path in list_checkpoints(model.save)]
    if model.overwrite and not model.load:  # the older run's checkpoints stay until this run's first save
        started = launcher_started_at()
        own = [path for path in own if Path(path).stat().st_mtime >= started]
    if own and model.load and Path(own[-1]).resolve() == Path(model.load).resolve():
        return run_config  # already resolved (`stacx train` resolves it before its checks, run_training again)
    resumed = dataclasses.replace(run_config, model=dataclasses.replace(model, load=own[-1])) if own else run_config
    if (environ or os.environ).get("RANK", "0") == "0":
        start = f"checkpoint {own[-1]}" if own else "the start"
        announce(f"restart {restarts} (torch elastic) from {start}")
    return resumed


def install_fault_hook(trainer: Any, *, generation: int, torchrun: bool, environ=None) -> None:
    """The test-only STACX_FAULT_KILL_AT_STEP hook (module doc), in the first generation only."""
    environ = os.environ if environ is None else environ
    at_step = environ.get(FAULT_KILL_AT_STEP_ENV)
    if not at_step or generation > 0:
        return
    at_step, rank = int(at_step), int(environ.get(FAULT_KILL_RANK_ENV, "0"))
    role = trainer.training_config.trainable_roles[0].name

    def kill(completed_steps: int) -> None:
        if completed_steps != at_step:
            return
        if torchrun:
            if int(environ.get("RANK", "0")) == rank:
                print(f"stacx train: {FAULT_KILL_AT_STEP_ENV}={at_step}: rank {rank} kills itself", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return
        import ray  # Imported here: Ray is slow to import; only a Ray run's driver gets here.

        actor = trainer.roles[role].workers.actors[rank]
        print(f"stacx train: {FAULT_KILL_AT_STEP_ENV}={at_step}: killing role {role!r} rank {rank}", file=sys.stderr,
              flush=True)
        ray.kill(actor, no_restart=True)  # the next call on the worker finds it dead (RoleWorkerDied)

    trainer.after_step = kill
