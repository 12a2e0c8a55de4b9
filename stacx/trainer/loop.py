"""`StacxTrainer`: the training loop, one step at a time, reading like the algorithm.

    for step in range(start, num_steps):                       # rollout steps
        eval/* of the model after `step` rollout steps, every eval_interval steps (0: the starting model)
        batch = rollout (responses, rewards, teacher log-probs)  |  the dataset's next batch
                | the step's file of --replay-rollouts (written to --dump-rollouts: stacx.trainer.rollout_dump)
        forward-only fields: reference log-probs (in-worker reference), old log-probs, inject syncs
        advantages (registry, by name) and returns for a critic
        for each mini-batch (num_epochs x num_steps_per_rollout of them, config/mini_batches.py):
            train every trainable role one optimizer step (DP shards; TP/CP peers get the same shard)
        push the policy's weights to the engine in buckets; the engine confirms the version
        log one row per optimizer step; checkpoint every save_interval rollout steps (and at the end)
    eval/* of the final model after num_steps rollouts (its own row) when due

A metrics row's `step` is the number of optimizer steps done before it (what the progress bar
counts); `rollout_step` groups a rollout's rows. Row 0 holds the starting model's eval and the first
optimizer step; the eval of the model after k rollout steps is in row k x optimizer_steps_per_rollout,
the first row of rollout k; the rollout's own metrics (rollout/*, time/*, exchange/*) are in its last
row. With one optimizer step per rollout both counts are the same. A run resumed at its checkpoint's
rollout step N starts at row N x optimizer_steps_per_rollout: no second eval of step 0.

Old log-probs (pi_old) are computed once per rollout, before its first update: with several
optimizer steps per rollout they are the proximal policy of every mini-batch (the resolved
`recompute_old_log_probs`), while the engine's log-probs stay the behaviour policy of the
off-policy corrections. With one optimizer step per rollout (async included) pi_old is the
training forward's own detached log-probs: the same weights, no extra forward.

The loop talks to roles through `RoleGroup`s (Ray workers or torchrun processes, see
stacx/trainer/cluster/protocol.py), so the same code drives a Ray run and a torchrun SPMD job. Any failure kills the
workers (`on_failure`) before the error propagates: a `RoleWorkerError` already names the role and
rank, and surviving ranks blocked in a collective never keep the run alive.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

import torch

from stacx.checkpointing.folders import is_model_folder
from stacx.objectives import get_advantage
from stacx.objectives.advantages_returns import gae_returns
from stacx.objectives.algorithm_config import AlgorithmConfig, as_algorithm_config
from stacx.parallel.reduction import StepCounts, count_loss_tokens
from stacx.rollout.asynchronous.async_rollout import AsyncRollout
from stacx.rollout.engine_health import EnginesBehind
from stacx.rollout.service import RolloutService
from stacx.rollout.weight_check import check_due
from stacx.trainer.batch import StepBatch, StepDataSource, plan_micro_batches
from stacx.trainer.checkpoint import (
    CheckpointError,
    begin_checkpoint,
    capture_rng_state,
    check_save_folder,
    commit_checkpoint,
    load_checkpoint,
    remove_checkpoints,
    remove_stale_staging_folders,
    remove_staging_folders,
    restore_rng_state,
)
from stacx.trainer.cluster.protocol import Channel, ExchangeGroup, RoleGroup
from stacx.trainer.config.layout import RoleLayout
from stacx.trainer.config.mini_batches import mini_batch_indices, resolve_mini_batch_schedule, sample_groups
from stacx.trainer.config.recipe import TrainingConfig, role_checkpoint_path, role_wants_reference
from stacx.trainer.config.resolve import check_resumed_algorithm, resolved_run_config_dict
from stacx.trainer.config.run import RunConfig
from stacx.trainer.exchange import ExchangeSchedule
from stacx.trainer.heartbeat import Heartbeat
from stacx.trainer.interrupts import raise_if_interrupted, stop_on_termination_signals
from stacx.trainer.metrics import ROLLOUT_STEP_KEY, MetricsLogger
from stacx.trainer.numerics import NonFiniteGuard
from stacx.trainer.rollout_dump import RolloutDumpWriter
from stacx.trainer.sample_sources import AsyncRolloutSamples, NoSamples, SampleSource, choose_sample_source
from stacx.wire.types import EngineTarget

logger = logging.getLogger(__name__)

ROLLOUT_STEP_METRIC = ROLLOUT_STEP_KEY
"""Key of the rollout step in every metrics row (a row's `step` is its optimizer step)."""
REFRESH_WEIGHTS = "refresh_weights_version"
"""What the driver shares instead of a step's batch when restarted engines need the current weights first."""
MAX_WEIGHT_REFRESHES_PER_STEP = 3
"""Times one step's rollout starts again after pushing the weights to restarted engines; then the run stops."""

WEIGHT_BUCKET_BYTES = 256 * 1024 * 1024
"""Weight-sync bucket size: hundreds of MB per message keeps large syncs fast."""


class StacxTrainer:
    """Drives one run. Build it with `stacx.trainer.factory.create_trainer` (Ray) or `run_spmd` (torchrun)."""

    def __init__(self, *, run_config: RunConfig, training_config: TrainingConfig, algorithm: AlgorithmConfig,
                 roles: Mapping[str, RoleGroup], channel: Channel, data: Optional[StepDataSource],
                 rollout: Optional[RolloutService] = None,
                 make_metrics_logger: Optional[Callable[[int], MetricsLogger]] = None,
                 on_failure: Callable[[], None] = lambda: None, on_close: Callable[[], None] = lambda: None,
                 close_engine_clients: Callable[[], None] = lambda: None,
                 exchanges: Optional[Mapping[str, ExchangeGroup]] = None, step_rollout: Optional[Any] = None,
                 sample_source: Optional[SampleSource] = None):
        """step_rollout: where the driver's samples come from instead of a StepRollout over `rollout` and
        `data` (anything with `collect(step)` and `evaluate_if_due(step)`, e.g. an external agent's
        sessions, stacx.rollout.agents.agent_rollout.AgentRollout); weights still go to `rollout`'s engine.
        sample_source: the run's `SampleSource`; None: `choose_sample_source` picks it from the run config,
        the recipe, `data`, `rollout` and `step_rollout` (the one place the kind of source is decided)."""
        self.run_config = run_config
        self.training_config = training_config
        self.algorithm = as_algorithm_config(algorithm, "StacxTrainer(algorithm=...)")
        self.roles = dict(roles)
        self.channel = channel
        self.data = data
        self.rollout = rollout
        self.make_metrics_logger = make_metrics_logger
        """Builds the driver's MetricsLogger for the first step this run trains (after a resume)."""
        self.metrics_logger = None
        self.on_failure = on_failure
        self.on_close = on_close
        self.close_engine_clients = close_engine_clients
        """Closes the engine clients the driver's own role runtime holds (torchrun rank 0): before the
        rollout service stops the servers they talk to."""
        self.role_graph = training_config.role_graph()
        self.exchange_schedule = ExchangeSchedule(training_config, exchanges, self.roles,
                                                  every_n_steps_override=run_config.train.exchange_every_n_steps)
        """Exchange syncs (e.g. a reference refreshed from the policy) run after the train phase when due."""
        # Driver-side instances answer what each role needs (reference, old log-probs); they hold no model.
        self.specializations = {role.name: role.specialization_cls(algorithm, None) for role in training_config.roles}
        self._check_reference_inputs()
        # Every rank that streams weights needs the servers' URLs and shared secret (shared as plain
        # values: rank messages carry no rollout types).
        shared = channel.share((rollout.engine_kind, tuple(rollout.urls), rollout.api_key) if rollout is not None else None)
        self.engine_target: Optional[EngineTarget] = (
            EngineTarget(*shared, weight_transfer=run_config.rollout.weight_transfer_for(shared[0]))
            if shared is not None else None)
        self.samples: SampleSource = sample_source if sample_source is not None else choose_sample_source(
            run_config=run_config, training_config=training_config, algorithm=self.algorithm, data=data,
            rollout=rollout, is_driver=channel.is_driver, step_rollout=step_rollout)
        """Where each step's batch comes from: a dataset, the driver's step rollout, an agent's sessions, the
        asynchronous producer, or nothing on a rank that is not the driver (stacx.trainer.sample_sources)."""
        self.mini_batches = resolve_mini_batch_schedule(run_config.rollout, run_config.train,
                                                        data_source=training_config.data_source)
        """global_batch_size, num_steps_per_rollout, num_epochs: the optimizer steps of each rollout."""
        self.step = 0
        self.update_rows: list[dict[str, float]] = []
        """The role metrics of a rollout step's optimizer steps before its last one (`log` writes them
        as their own rows; the last one's are in the step's metrics)."""
        self.last_metrics: dict[str, float] = {}
        self._saved_once = False
        self.heartbeat = Heartbeat("", enabled=False)
        """The running phase's heartbeat (stacx.trainer.heartbeat); `beat` starts one."""
        self.nonfinite = NonFiniteGuard(run_config.train.skip_nonfinite_steps)
        """Stops the run at the first NaN/inf (or skips up to --skip-nonfinite-steps steps)."""
        self.rollout_dump = (RolloutDumpWriter(run_config.train.dump_rollouts, recipe=training_config.name,
                                               seed=run_config.train.seed, train_section=run_config.to_dict().get("train"))
                             if run_config.train.dump_rollouts and channel.is_driver else None)
        """--dump-rollouts: the driver's writer of each step's batch (stacx.trainer.rollout_dump)."""
        self.run_counters: dict[str, float] = {}
        """Counters logged in every trained row (`run/restarts` of stacx.trainer.restarts)."""
        self.after_step: Callable[[int], None] = lambda completed_steps: None
        """Called after each rollout step is logged (and saved when due); stacx.trainer.restarts' test-only
        fault hook uses it."""

    @property
    def step_rollout(self) -> Optional[Any]:
        """The driver's step rollout (`stacx.rollout.step_rollout.StepRollout`: roll-ins, DAPO shaping and
        sampling, eval, rollout dumps; or an agent's `AgentRollout`), the sample source's; None elsewhere."""
        return self.samples.step_rollout

    @step_rollout.setter
    def step_rollout(self, rollout: Optional[Any]) -> None:
        if "samples" not in self.__dict__:  # a trainer made without __init__ (a test of one method)
            self.samples = NoSamples()
        self.samples.step_rollout = rollout

    @property
    def async_rollout(self) -> Optional[AsyncRollout]:
        """--rollout-mode async: the driver's producer thread and scheduler, once started; None otherwise."""
        return self.samples.async_rollout if isinstance(self.samples, AsyncRolloutSamples) else None

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """Train from the start (or the --load checkpoint) to train.num_steps; returns the last metrics.
        SIGTERM/SIGINT raise `RunInterrupted` (stacx.trainer.interrupts) so that the teardown runs."""
        with stop_on_termination_signals():
            return self._run()

    def _run(self) -> dict[str, float]:
        try:
            self.check_save_folder()
            with self.beat("resuming", "loading the checkpoint") if self.run_config.model.load else nullcontext():
                self.step = self.resume_if_requested()
            if self.channel.is_driver and self.make_metrics_logger is not None:
                self.metrics_logger = self.make_metrics_logger(self.step)
            if self.step > 0 and self.engine_target is not None:
                self.push_policy_weights(version=self.step)  # a fresh engine serves the initial weights
            self.samples.start(version=self.step)  # the async producer generates while the trainer trains
            train = self.run_config.train
            for step in range(self.step, train.num_steps):
                raise_if_interrupted()  # a signal whose exception was lost stops the run here (interrupts.py)
                with self.beat(f"step {step + 1}/{train.num_steps}", "batch"):
                    evaluated = self.evaluate_if_due(step)  # the weights the engine serves now: `step` steps done
                    metrics = self.train_one_step(step)
                    metrics.update(evaluated)
                    self.step = step + 1
                    self.log(step, metrics)
                    if self.should_save(self.step):
                        raise_if_interrupted()  # no checkpoint is written after a signal
                        self.heartbeat.phase = "saving the checkpoint"
                        self.save_checkpoint(self.step)
                    self.after_step(self.step)
            with self.beat("the final model", "eval"):
                final_eval = self.evaluate_if_due(train.num_steps)
            if final_eval:  # the trained model's own row; the progress bar stays at num_steps
                self.log(train.num_steps, final_eval, trained=False)
            if train.export_hf:
                with self.beat("exporting", train.export_hf):
                    self.export_policy(train.export_hf)
        except BaseException:
            # Teardown after a failure must not replace the failure's own error.
            for teardown in (self.close_engine_clients, self.on_failure, self._close_driver_side):
                try:
                    teardown()
                except Exception:  # noqa: BLE001 - the run's error is already propagating
                    logger.exception("teardown after a failed run failed")
            raise
        self.close()
        return self.last_metrics

    def beat(self, prefix: str, phase: str) -> Heartbeat:
        """A heartbeat for one phase of the run, printed by the driver (`self.heartbeat.phase` renames it)."""
        self.heartbeat = Heartbeat(prefix, phase, enabled=self.channel.is_driver, detail=self.samples.waiting_for)
        return self.heartbeat

    def check_save_folder(self) -> None:
        """Refuse (on every rank alike) a --save folder holding another run's checkpoints, see checkpoint.py."""
        model = self.run_config.model
        if not model.save:  # the same run config on every rank: all return here alike
            return
        problem = None
        if self.channel.is_driver:
            try:
                check_save_folder(model.save, load=model.load, overwrite=model.overwrite)
            except CheckpointError as err:
                problem = str(err)
        problem = self.channel.share(problem)
        if problem:
            raise CheckpointError(problem)
        if self.channel.is_driver:
            self.remove_stale_staging()

    def remove_stale_staging(self) -> None:
        """The staging folders a killed run left under --save (driver; at the start and before each save)."""
        for path in remove_stale_staging_folders(self.run_config.model.save):
            logger.warning("removed %s, the unfinished save of a run that was killed or crashed", path)

    def train_one_step(self, step: int) -> dict[str, float]:
        """One rollout step; a non-finite reward, advantage, loss or grad norm stops the run (or skips the
        step, see `stacx.trainer.numerics`) before any weights are saved, exported or pushed. Returns the
        step's metrics with its last optimizer step's role metrics; the earlier optimizer steps' role
        metrics are left in `self.update_rows`."""
        self.update_rows = []
        started = time.monotonic()
        self.heartbeat.phase = self.samples.phase
        batch, metrics = self.shared_batch(step)
        sample_role = (self.training_config.rollout_role or self.training_config.trainable_roles[0]).name
        if self.nonfinite.check_samples(step=step, role=sample_role, name="reward", values=batch.rewards or ()):
            return self._skipped_step(metrics, started)
        self.fill_forward_fields(batch)
        metrics.update(self.samples.trained_batch_metrics(batch))  # async: the behaviour policy's importance weights
        if self.algorithm_has_advantages:
            self.compute_advantages(batch)
            if self.nonfinite.check_samples(step=step, role=sample_role, name="advantage", values=batch.advantages):
                return self._skipped_step(metrics, started)
        updates = [{} for _ in range(self.mini_batches.optimizer_steps_per_rollout)]
        for index, indices in enumerate(self.plan_mini_batches(batch, step)):
            mini_batch = batch if len(updates) == 1 else batch.select(indices)
            for role in self.training_config.trainable_roles:
                self.heartbeat.phase = f"training {role.name}" + (f" ({index + 1}/{len(updates)})" if len(updates) > 1 else "")
                role_metrics = self.train_role(role.name, mini_batch)
                updates[index].update({f"{role.name}/{k}": v for k, v in role_metrics.items()})
                self.nonfinite.check_metrics(step=step, role=role.name, metrics=role_metrics)
        self.update_rows = updates[:-1]
        metrics.update(updates[-1])
        metrics["train/nonfinite_skipped_steps"] = float(len(self.nonfinite.skipped_steps))
        metrics.update(self.exchange_schedule.run_due(completed_steps=step + 1))
        if self.engine_target is not None:
            self.heartbeat.phase = "weight sync"
            self.push_policy_weights(version=step + 1)
        metrics["time/step_s"] = time.monotonic() - started
        return metrics

    def _skipped_step(self, metrics: dict[str, float], started: float) -> dict[str, float]:
        """The metrics of a step skipped before training (non-finite rewards or advantages); its
        optimizer steps' rows are empty but for the rollout step (`log`)."""
        self.update_rows = [{} for _ in range(self.mini_batches.optimizer_steps_per_rollout - 1)]
        metrics["train/nonfinite_skipped_steps"] = float(len(self.nonfinite.skipped_steps))
        metrics["time/step_s"] = time.monotonic() - started
        return metrics

    # ---- data ------------------------------------------------------------------------------

    def shared_batch(self, step: int) -> tuple[StepBatch, dict]:
        """The step's batch from the driver, on every rank. When the step's rollout found too few engines
        live but enough restarted behind the pool's weights (a single engine that died: `EnginesBehind`,
        stacx.rollout.engine_health), every rank pushes the current weights to them and the rollout
        starts again (a synchronous source collects the step again from its start, its own prompts; the
        asynchronous producer sends the groups that waited again and the step takes its batch)."""
        refreshes = 0
        while True:
            batch, metrics = self.channel.share(self._driver_batch_or_refresh(step, refreshes)
                                                if self.channel.is_driver else None)
            if batch is not None:
                return batch, metrics
            self.push_policy_weights(version=int(metrics[REFRESH_WEIGHTS]))
            refreshes += 1

    def _driver_batch_or_refresh(self, step: int, refreshes: int):
        try:
            return self.driver_batch(step)
        except EnginesBehind as behind:
            if refreshes >= MAX_WEIGHT_REFRESHES_PER_STEP:
                raise
            logger.warning("step %d: %s: pushing the weights of version %d to them and rolling out again",
                           step + 1, behind, behind.version)
            return None, {REFRESH_WEIGHTS: float(behind.version)}

    def driver_batch(self, step: int) -> tuple[StepBatch, dict]:
        """The step's batch on the driver from the sample source (--replay-rollouts: the dump's file), written
        to --dump-rollouts as it reaches the trainer, before any field the trainer adds."""
        batch, metrics = self.collect_batch(step)
        if self.rollout is not None:
            metrics.update(self.rollout.fault_metrics())  # engine restarts, re-issued requests
        if self.rollout_dump is not None:
            seconds, size = self.rollout_dump.write(step, batch, metrics, getattr(self.samples, "last_samples", None))
            metrics.update({"time/rollout_dump_s": seconds, "rollout_dump/bytes": float(size)})
        return batch, metrics

    def collect_batch(self, step: int) -> tuple[StepBatch, dict]:
        """(step batch, rollout metrics), on the driver, from the run's sample source."""
        return self.samples.collect(step)

    # ---- forward-only fields and advantages ------------------------------------------------

    @property
    def algorithm_has_advantages(self) -> bool:
        return self.training_config.algorithm is not None

    def _wants_reference(self, role) -> bool:
        return role_wants_reference(role, self.training_config, self.algorithm)

    def _check_reference_inputs(self) -> None:
        for role in self.training_config.roles:
            if not self._wants_reference(role):
                continue
            arg = role.reference_checkpoint_arg
            if arg is None or role_checkpoint_path(role, self.run_config.model, arg) is None:
                flag = "--" + (arg or "ref_load").replace("_", "-")
                raise ValueError(f"role {role.name!r} needs reference log-probs (KL to the reference); set {flag}")

    def fill_forward_fields(self, batch: StepBatch) -> None:
        """Reference/old log-probs of each trainable role, then inject syncs in dependency order."""
        for role in self.training_config.trainable_roles:
            names = []
            if self._wants_reference(role):
                names.append("ref_log_probs")
            if self.specializations[role.name].needs_old_log_probs():
                names.append("log_probs")
            if names:
                self.role_fields(role.name, batch, names)
        for sync in self.role_graph.inject_syncs:
            self.role_fields(sync.source_role, batch, list(sync.keys))

    def role_fields(self, role_name: str, batch: StepBatch, names: list[str]) -> None:
        """Run `compute_fields` on a role's ranks and write the per-sample results into `batch`."""
        group = self.roles[role_name]
        plan = self.plan(role_name, batch)
        results = group.compute_fields(
            [[batch.select(mb) for mb in plan[coords.dp_rank]] for coords in group.coords], names)
        filled = {name: [None] * batch.num_samples for name in names}
        for coords, result in zip(group.coords, results):
            if result is None:
                continue
            for indices, fields in zip(plan[coords.dp_rank], result):
                for name in names:
                    for index, value in zip(indices, fields[name]):
                        filled[name][index] = value
        for name, values in filled.items():
            batch.set_field(name, values)
            missing = [i for i, value in enumerate(values) if value is None]
            if missing:
                raise RuntimeError(f"role {role_name!r} returned no {name!r} for samples {missing[:5]}")

    def compute_advantages(self, batch: StepBatch) -> None:
        """advantages (and returns for a value-head role) from the registry's estimator, by name.

        The estimator reads the step batch itself (`prompt_id`, `log_probs`, ... under their one
        name), its rewards as float64."""
        rollout_data = replace(batch, rewards=torch.tensor(batch.rewards, dtype=torch.float64))
        estimator = get_advantage(self.algorithm.advantage_estimator)
        advantages = estimator(self.algorithm, rollout_data)
        batch.advantages = [a.float() for a in advantages]
        if any(role.outputs_values for role in self.training_config.roles):
            # A plugin estimator's own returns (padded adapters keep them as `.returns`) are the critic targets.
            plugin_returns = getattr(advantages, "returns", None)
            batch.returns = ([r.float() for r in plugin_returns] if plugin_returns is not None
                             else gae_returns(self.algorithm, rollout_data))

    # ---- training --------------------------------------------------------------------------

    def plan(self, role_name: str, batch: StepBatch) -> list[list[list[int]]]:
        layout = self.roles[role_name].layout
        return plan_micro_batches(
            batch, dp_size=layout.data_parallel_size, cp_size=layout.context_parallel_size,
            max_tokens_per_micro_batch=self.run_config.train.max_tokens_per_micro_batch,
            pp_size=layout.pipeline_model_parallel_size,
            interleaved=self.run_config.model.num_layers_per_virtual_pipeline_stage is not None)

    def plan_mini_batches(self, batch: StepBatch, step: int) -> list[list[int]]:
        """Sample indices of each optimizer step of rollout step `step` (seeded: the same on every rank)."""
        schedule = self.mini_batches
        if schedule.optimizer_steps_per_rollout == 1:
            return [list(range(batch.num_samples))]
        groups, whole = sample_groups(batch.prompt_id, batch.pair_ids, batch.num_samples)
        return mini_batch_indices(groups, num_steps_per_rollout=schedule.num_steps_per_rollout,
                                  num_epochs=schedule.num_epochs, seed=self.run_config.train.seed,
                                  rollout_step=step, keep_groups_whole=whole)

    def train_role(self, role_name: str, batch: StepBatch) -> dict[str, float]:
        """One optimizer step of a role over `batch` (a mini-batch of the rollout): its loss is normalized
        by this batch's own token and sequence counts. Metrics are identical on every rank."""
        group = self.roles[role_name]
        plan = self.plan(role_name, batch)
        num_tokens, num_sequences = count_loss_tokens(batch.loss_masks)
        counts = StepCounts(num_tokens=num_tokens, num_sequences=num_sequences)
        norm_length = float(self.run_config.rollout.rollout_max_response_len)
        results = group.train_step(
            [[batch.select(mb) for mb in plan[coords.dp_rank]] for coords in group.coords], counts, norm_length)
        return results[0]

    # ---- weights, logging, checkpoints -----------------------------------------------------

    def push_policy_weights(self, version: int) -> None:
        """Pause the engine, stream the rollout role's weights in buckets, resume, check the version.
        In async mode the scheduler's update window brackets it: begin_update (abort the in-flight
        requests with partial rollout, else wait for them) ... publish_version (the published version
        again: restarted engines refreshed, `shared_batch`)."""
        target = self.engine_target
        role = self.training_config.rollout_role
        self.samples.begin_update()
        if self.channel.is_driver:
            self.rollout.begin_weight_update()
        try:
            # every live rollout engine takes the update (a set-aside one when it rejoins, stacx.rollout.engine_health);
            # finish_weight_update checks each version
            check = check_due(version, self.run_config.rollout.weight_check_every)  # the post-sync digest check
            push_urls = getattr(self.rollout, "weight_push_urls", lambda: target.urls)
            urls = self.channel.share(tuple(push_urls()) if self.channel.is_driver else None)
            for url in urls:
                self.push_weights_to(role.name, target, url, version, check)
        except BaseException:
            # Resume without the version check: a stale-version error would hide the push's own error.
            if self.channel.is_driver:
                self.rollout.abort_weight_update()
            raise
        if self.channel.is_driver:
            self.rollout.finish_weight_update(version)
        self.samples.publish_version(version)

    def push_weights_to(self, role_name: str, target: EngineTarget, url: str, version: int,
                        check: bool = False) -> None:
        """Push to one engine (check: then compare its per-tensor digests with the sent ones); a push that
        failed because the engine did not answer is retried once on it, after the rollout service restarted
        or recovered it ('skip': set aside, it rejoins later), on Ray and under torchrun alike."""
        try:
            self.roles[role_name].push_weights(target.kind, url, version, WEIGHT_BUCKET_BYTES, target.api_key, check,
                                               **target.push_options())
            return
        except Exception as err:  # noqa: BLE001 - the rollout service decides; re-raised unless it recovers
            # The driver decides and every rank follows: on Ray it drives alone; under torchrun every rank
            # raised this error together (stacx.trainer.runtime.push_outcome), else no rank may retry alone.
            if not (getattr(self.channel, "drives_alone", False) or getattr(self.roles[role_name], "fails_together", False)):
                raise
            recover = getattr(self.rollout, "recover_engine", None) if self.channel.is_driver else None
            action = self.channel.share((recover(url, err) if recover is not None else "raise")
                                        if self.channel.is_driver else None)
            if action == "raise":
                raise
            logger.warning("weight push of version %d to %s failed (%s): %s", version, url, err,
                           "retrying on it" if action == "retry" else "it is set aside until it rejoins")
        if action == "retry":
            self.roles[role_name].push_weights(target.kind, url, version, WEIGHT_BUCKET_BYTES, target.api_key, check,
                                               **target.push_options())

    def evaluate_if_due(self, completed_steps: int) -> dict[str, float]:
        """eval/* of the model after `completed_steps` rollout steps when due (the driver's StepRollout
        decides, see evaluate_if_due there); {} on other ranks and in runs without rollouts."""
        if self.channel.is_driver and self.step_rollout is not None:
            self.heartbeat.phase = "eval"
            return self.samples.evaluate_if_due(completed_steps)
        return {}

    def log(self, step: int, metrics: dict[str, float], *, trained: bool = True) -> None:
        """The rows of rollout step `step`, one per optimizer step (see the module docstring): the
        earlier optimizer steps' role metrics from `self.update_rows`, then `metrics`; eval/* (of the
        model before this rollout's updates) goes to the rollout's first row. `trained=False`: the
        final model's eval/* only, in its own row (merged into last_metrics; the bar does not advance)."""
        per_rollout = self.mini_batches.optimizer_steps_per_rollout
        first = step * per_rollout
        if not trained:
            self.last_metrics = {**self.last_metrics, **metrics}
            if self.channel.is_driver and self.metrics_logger is not None:
                self.metrics_logger.log(first, {ROLLOUT_STEP_METRIC: step, **metrics}, trained=False)
            return
        metrics.update(self.run_counters)
        self.last_metrics = metrics
        rows = [*self.update_rows, dict(metrics)]
        self.update_rows = []
        if len(rows) > 1:
            evaluated = {key: rows[-1].pop(key) for key in list(rows[-1]) if key.startswith("eval/")}
            rows[0] = {**rows[0], **evaluated}
        if self.channel.is_driver and self.metrics_logger is not None:
            for index, row in enumerate(rows):
                self.metrics_logger.log(first + index, {ROLLOUT_STEP_METRIC: step, **row})

    def should_save(self, completed_steps: int) -> bool:
        train = self.run_config.train
        if not self.run_config.model.save:
            return False
        if completed_steps == train.num_steps:
            return True
        return bool(train.save_interval) and completed_steps % train.save_interval == 0

    def role_layouts(self) -> dict[str, RoleLayout]:
        return {name: group.layout for name, group in self.roles.items()}

    def save_checkpoint(self, step: int) -> str | None:
        """Every rank writes its state into a staging folder; the driver commits it atomically."""
        root = self.run_config.model.save
        if self.channel.is_driver and not self._saved_once and self.run_config.model.overwrite and not self.run_config.model.load:
            # --overwrite: the older run's steps go at this run's first save (its later steps would look newer).
            for path in remove_checkpoints(root):
                logger.warning("--overwrite: removed %s of an earlier run", path)
        self._saved_once = True
        if self.channel.is_driver:
            self.remove_stale_staging()
        staging = self.channel.share(begin_checkpoint(root, step) if self.channel.is_driver else None)
        rank_files = []
        for group in self.roles.values():
            rank_files += group.save(staging)
        final = None
        if self.channel.is_driver:
            driver_state = {"step": step, **self.samples.state_dict(), "rng": capture_rng_state()}
            final = commit_checkpoint(staging, step=step, recipe=self.training_config, role_layouts=self.role_layouts(),
                                      rank_files=rank_files, driver_state=driver_state,
                                      resolved_run_config=resolved_run_config_dict(
                                          self.run_config, self.algorithm, recipe=self.training_config.name))
            logger.info("checkpoint of step %d written to %s", step, final)
        self.channel.barrier()
        return final

    def resume_if_requested(self) -> int:
        """Load `model.load` (a step folder or a root holding them) into every rank; returns the step."""
        path = self.run_config.model.load
        if not path:
            return 0
        if is_model_folder(path):  # a Hugging Face or torch_dist model, not a training checkpoint: start weights
            role = self.training_config.rollout_role or self.training_config.trainable_roles[0]
            self.roles[role.name].load_start_weights(os.fspath(path))
            if self.channel.is_driver:
                print(f"role {role.name!r} starts from the weights of --load {path} (step 0)", flush=True)
            return 0
        # Every file is read with torch.load(weights_only=True): a checkpoint cannot run code on resume.
        loaded = load_checkpoint(path, expected_recipe=self.training_config, expected_layouts=self.role_layouts())
        check_resumed_algorithm(loaded.run_config(), self.algorithm, where=loaded.path)
        self.check_resumed_mini_batches(loaded.run_config(), where=loaded.path)
        for group in self.roles.values():
            group.load(loaded)
        driver_state = loaded.driver_state()
        self.samples.load_state_dict(driver_state)
        restore_rng_state(driver_state["rng"])
        logger.info("resumed from %s at step %d", loaded.path, loaded.step)
        if self.channel.is_driver:
            print(f"resumed from step {loaded.step} ({loaded.path})", flush=True)
        return loaded.step

    def check_resumed_mini_batches(self, saved_run_config: dict, where: str) -> None:
        """Refuse to resume a checkpoint trained with another mini-batch schedule: its LR schedule, optimizer
        state and metrics rows count the saved run's optimizer steps. Checkpoints are written at rollout
        boundaries only, so a resume with the same schedule continues exactly."""
        saved = saved_run_config.get("train") or {}
        current = self.mini_batches
        changed = [f"--{name.replace('_', '-')}: saved {saved[name]}, now {getattr(current, name)}"
                   for name in ("global_batch_size", "num_steps_per_rollout", "num_epochs")
                   if saved.get(name) is not None and saved[name] != getattr(current, name)]
        if current.optimizer_steps_per_rollout > 1 and saved.get("num_steps_per_rollout") is None:
            changed.append(f"--num-steps-per-rollout: saved 1 (one optimizer step per rollout), now "
                           f"{current.num_steps_per_rollout} x --num-epochs {current.num_epochs}")
        if changed:
            raise CheckpointError(f"checkpoint {where} was trained with another mini-batch schedule ({'; '.join(changed)}); "
                                  "its LR schedule and optimizer state count those optimizer steps. Resume with the "
                                  "flags it was saved with (its run_config.json) or start a fresh run")

    def export_policy(self, out_dir: str) -> None:
        role = self.training_config.rollout_role or self.training_config.trainable_roles[0]
        self.roles[role.name].export_hf(os.fspath(out_dir))

    # ---- teardown --------------------------------------------------------------------------

    def _close_driver_side(self) -> None:
        """Logger, rollout service (its clients and the servers it started) and this run's uncommitted
        checkpoint staging folders; each step runs even when an earlier one fails."""
        try:
            self._close_logger_and_rollout()
        finally:
            if self.channel.is_driver and self.run_config.model.save:
                for path in remove_staging_folders(self.run_config.model.save):
                    logger.warning("removed the unfinished checkpoint staging folder %s", path)

    def _close_logger_and_rollout(self) -> None:
        try:  # first: the asynchronous producer aborts its requests on the engine closed below
            self.samples.close()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            logger.exception("closing the sample source failed")
        if self.metrics_logger is not None:
            try:
                self.metrics_logger.close()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                logger.exception("closing the metrics logger failed")
            self.metrics_logger = None
        if self.rollout is not None:
            rollout, self.rollout = self.rollout, None
            rollout.close()

    def close(self) -> None:
        """Release workers, engine, teacher and logger after a finished run (workers even when the
        engine's close fails)."""
        try:
            try:
                self.close_engine_clients()
            finally:
                self._close_driver_side()
        finally:
            self.on_close()
