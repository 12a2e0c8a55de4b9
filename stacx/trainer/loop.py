"""`StacxTrainer`: the training loop, one step at a time, reading like the algorithm.

    for step in range(start, num_steps):                       # rollout steps
        eval/* of the model after `step` rollout steps, every eval_interval steps (0: the starting model)
        batch = rollout (responses, rewards, teacher log-probs)  |  the dataset's next batch
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
role_groups.py), so the same code drives a Ray run and a torchrun SPMD job. Any failure kills the
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
from stacx.rollout.agent_rollout import AgentRollout, agent_from_settings, last_turn_reward
from stacx.rollout.async_rollout import AsyncRollout, importance_weight_metrics
from stacx.rollout.rewards import resolve_reward_fn
from stacx.rollout.evaluation import RolloutDumper
from stacx.rollout.step_rollout import StepRollout, uniform_reward_warning
from stacx.rollout.types import EngineTarget
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
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.exchange import ExchangeSchedule
from stacx.trainer.heartbeat import Heartbeat
from stacx.trainer.interrupts import stop_on_termination_signals
from stacx.trainer.metrics import ROLLOUT_STEP_KEY, MetricsLogger
from stacx.trainer.numerics import NonFiniteGuard

logger = logging.getLogger(__name__)

ROLLOUT_STEP_METRIC = ROLLOUT_STEP_KEY
"""Key of the rollout step in every metrics row (a row's `step` is its optimizer step)."""
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
                 exchanges: Optional[Mapping[str, ExchangeGroup]] = None, step_rollout: Optional[Any] = None):
        """step_rollout: where the driver's samples come from instead of a StepRollout over `rollout` and
        `data` (anything with `collect(step)` and `evaluate_if_due(step)`, e.g. an external agent's
        sessions, stacx.rollout.agent_rollout.AgentRollout); weights still go to `rollout`'s engine."""
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
        self.engine_target: Optional[EngineTarget] = EngineTarget(*shared) if shared is not None else None
        if step_rollout is not None and run_config.rollout.rollout_mode == "async":
            raise ValueError("--rollout-mode async draws its own prompts; a given step_rollout (an agent's sessions) "
                             "needs --rollout-mode sync")
        self.step_rollout = step_rollout if step_rollout is not None else (
            self._build_step_rollout() if rollout is not None and channel.is_driver else None)
        """The driver's `rollout_steps.StepRollout`: roll-ins, DAPO shaping and sampling, eval, rollout dumps."""
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
        self.async_rollout: Optional[AsyncRollout] = None
        """--rollout-mode async: the driver's producer thread and scheduler (`start_async_rollout`)."""
        self._async_resume_state: dict = {}

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
            self.start_async_rollout()
            train = self.run_config.train
            for step in range(self.step, train.num_steps):
                with self.beat(f"step {step + 1}/{train.num_steps}", "batch"):
                    evaluated = self.evaluate_if_due(step)  # the weights the engine serves now: `step` steps done
                    metrics = self.train_one_step(step)
                    metrics.update(evaluated)
                    self.step = step + 1
                    self.log(step, metrics)
                    if self.should_save(self.step):
                        self.heartbeat.phase = "saving the checkpoint"
                        self.save_checkpoint(self.step)
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
        self.heartbeat = Heartbeat(prefix, phase, enabled=self.channel.is_driver,
                                   detail=getattr(self.step_rollout, "waiting_for", None))
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
        self.heartbeat.phase = "rollout" if self.training_config.data_source == "rollout" else "batch"
        batch, metrics = self.channel.share(self.collect_batch(step) if self.channel.is_driver else None)
        sample_role = (self.training_config.rollout_role or self.training_config.trainable_roles[0]).name
        if self.nonfinite.check_samples(step=step, role=sample_role, name="reward", values=batch.rewards or ()):
            return self._skipped_step(metrics, started)
        self.fill_forward_fields(batch)
        if self.run_config.rollout.rollout_mode == "async" and batch.log_probs is not None \
                and batch.rollout_log_probs is not None:
            metrics.update(importance_weight_metrics(batch.log_probs, batch.rollout_log_probs, batch.loss_masks,
                                                     threshold=float(self.algorithm.tis_threshold)))
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

    def collect_batch(self, step: int) -> tuple[StepBatch, dict]:
        """(step batch, rollout metrics), on the driver: async mode takes the scheduler's batch of `step`."""
        # data is None when the step rollout draws its own tasks (stacx.rollout.agent_rollout.AgentRollout)
        if self.training_config.data_source == "dataset" or (self.data is not None and self.data.kind == "trajectory"):
            batch = self.data.next_dataset_batch()
            lengths = batch.response_lengths
            return batch, {"data/response_length_mean": sum(lengths) / len(lengths)}
        if self.async_rollout is not None:
            samples, metrics = self.async_rollout.take_batch(step)
            self.step_rollout.summarize(step, samples, metrics)
        else:
            samples, metrics = self.step_rollout.collect(step)
        batch = StepBatch.from_samples(samples)
        if self.run_config.rollout.use_routing_replay and batch.routed_experts is None:
            raise ValueError("--use-routing-replay: the rollout returned no routed experts (multi-turn environment "
                             "episodes, DAgger roll-ins and --agent rollouts do not carry them yet); drop the flag")
        batch.rewards = self.shaped_rewards(batch)
        if batch.teacher_log_probs is not None:  # over student-executed tokens (teacher ones hold the +1.0 sentinel)
            metrics["rollout/teacher_log_prob_mean"] = _masked_mean(
                batch.teacher_log_probs, [m * (t <= 0) for t, m in zip(batch.teacher_log_probs, batch.loss_masks)])
        return batch, metrics

    def start_async_rollout(self) -> None:
        """--rollout-mode async (driver): start the producer at the current step's version, so that it
        generates while the trainer trains; in-flight groups of a checkpoint are regenerated."""
        if self.run_config.rollout.rollout_mode != "async" or self.step_rollout is None:
            return
        self.async_rollout = AsyncRollout(self.rollout, self.data, self.step_rollout,
                                          rollout_section=self.run_config.rollout, start_version=self.step,
                                          resume_state=self._async_resume_state)
        self.async_rollout.start()

    def _build_step_rollout(self):
        section = self.run_config.rollout
        if section.agent or section.agent_command:
            return self._build_agent_rollout()
        return StepRollout(self.rollout, self.data, rollout=self.run_config.rollout,
                           plan=rollout_plan(self.training_config, self.run_config), algorithm=self.algorithm,
                           out_dir=self.run_config.logging.out)

    def _build_agent_rollout(self) -> AgentRollout:
        """--agent / --agent-command: each prompt row is a task the user's agent runs n_samples_per_prompt
        times against the engine's OpenAI-compatible endpoint; its recorded turns are the samples."""
        section, tokenizer = self.run_config.rollout, self.rollout.tokenizer

        def next_tasks(step: int) -> list[dict]:
            return [{"prompt": tokenizer.decode(example.prompt_ids), "label": example.label,
                     "metadata": dict(example.metadata), "source": example.source}
                    for example in self.data.next_examples(self.data.batch_size)]

        def uniform_rewards(step: int, samples) -> Optional[str]:
            if self.algorithm.advantage_estimator == "gae":  # a critic's advantages are not 0 then
                return None
            return uniform_reward_warning(step, samples, n_samples_per_prompt=section.n_samples_per_prompt,
                                          temperature=section.rollout_temperature, reward_fn=section.reward_fn)

        dumper = (RolloutDumper(self.run_config.logging.out, per_step=section.save_rollouts_per_step, tokenizer=tokenizer)
                  if section.save_rollouts_per_step > 0 else None)
        agent = agent_from_settings(section.agent, section.agent_command, agent_timeout=section.agent_timeout,
                                    agent_env=section.agent_env)
        return AgentRollout(agent, server_url=self.rollout.url,
                            next_tasks=next_tasks, n_samples_per_task=section.n_samples_per_prompt,
                            reward_fn=last_turn_reward(resolve_reward_fn(section.reward_fn), tokenizer.decode),
                            max_parallel_episodes=section.agent_max_parallel_episodes, api_key=self.rollout.api_key,
                            dumper=dumper, uniform_reward_warning=uniform_rewards)

    def shaped_rewards(self, batch: StepBatch) -> list[float]:
        """opd_rl: R_i - teacher_kl_coef * sum_t m_it (log pi(a_t) - log pi_teacher(a_t)) (rollout log-probs)."""
        rewards = list(batch.rewards)
        coef = self.algorithm.teacher_kl_coef
        if coef == 0.0 or batch.teacher_log_probs is None:
            return rewards
        return [
            r - coef * float(((lp - tlp) * m).sum())
            for r, lp, tlp, m in zip(rewards, batch.rollout_log_probs, batch.teacher_log_probs, batch.loss_masks)
        ]

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
        requests with partial rollout, else wait for them) ... publish_version."""
        target = self.engine_target
        role = self.training_config.rollout_role
        if self.async_rollout is not None:
            self.async_rollout.begin_update()
        if self.channel.is_driver:
            self.rollout.begin_weight_update()
        try:
            check = check_due(version, self.run_config.rollout.weight_check_every)  # the post-sync digest check
            for url in target.urls:  # every rollout engine takes the update; finish_weight_update checks each version
                self.roles[role.name].push_weights(target.kind, url, version, WEIGHT_BUCKET_BYTES, target.api_key,
                                                   check)
        except BaseException:
            # Resume without the version check: a stale-version error would hide the push's own error.
            if self.channel.is_driver:
                self.rollout.abort_weight_update()
            raise
        if self.channel.is_driver:
            self.rollout.finish_weight_update(version)
        if self.async_rollout is not None:
            self.async_rollout.publish_version(version)

    def evaluate_if_due(self, completed_steps: int) -> dict[str, float]:
        """eval/* of the model after `completed_steps` rollout steps when due (the driver's StepRollout
        decides, see evaluate_if_due there); {} on other ranks and in runs without rollouts."""
        if self.channel.is_driver and self.step_rollout is not None:
            self.heartbeat.phase = "eval"
            return self.step_rollout.evaluate_if_due(completed_steps)
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
            driver_state = {"step": step, "data": self.data.state_dict() if self.data is not None else {},
                            "rng": capture_rng_state()}
            if self.async_rollout is not None:  # the generated, untrained groups: a resumed run trains them
                driver_state["data"], driver_state["async"] = self.async_rollout.checkpoint_state()
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
        if self.data is not None and driver_state.get("data"):
            self.data.load_state_dict(driver_state["data"])
        restore_rng_state(driver_state["rng"])
        self._async_resume_state = driver_state.get("async") or {}
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
        if self.async_rollout is not None:  # first: it aborts its requests on the engine closed below
            async_rollout, self.async_rollout = self.async_rollout, None
            try:
                async_rollout.close()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                logger.exception("closing the asynchronous rollout failed")
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


def _masked_mean(values, masks) -> float:
    total = sum(float((v * (m != 0)).sum()) for v, m in zip(values, masks))
    count = sum(float((m != 0).sum()) for m in masks)
    return total / count if count else 0.0
