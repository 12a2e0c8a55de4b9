"""Where the loop's training samples come from: one `SampleSource`, chosen once when the trainer is built.

    source = choose_sample_source(run_config=..., training_config=..., algorithm=..., data=..., rollout=...,
                                  is_driver=...)
    source.start(version)                          # the async producer starts; a no-op for the others
    batch, metrics = source.collect(step)          # the step's StepBatch and its rollout metrics
    source.evaluate_if_due(completed_steps)        # eval/* through the driver's step rollout, when due
    source.begin_update(); ...; source.publish_version(version)   # around a weight push (async only)
    driver_state.update(source.state_dict())       # the data position (and the async buffer) of a checkpoint

The sources:
- `DatasetSamples`: a fixed dataset's next batch (SFT, DPO, replayed trajectories);
- `RolloutSamples`: the driver's `StepRollout` (roll-ins, DAPO sampling, environments) or an external
  agent's sessions (`AgentRollout`, `--agent` / `--agent-command`), one synchronous rollout per step;
- `AsyncRolloutSamples`: `--rollout-mode async`, the producer thread's batch of each step;
- `NoSamples`: a rank that is not the driver (it receives the driver's batch over the channel);
- `ReplaySamples`: `--replay-rollouts`, the driver reads each step's batch from a rollout dump (no engine).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.rollout.agents.agent_rollout import AgentRollout, agent_from_settings, last_turn_reward
from stacx.rollout.agents.episode_engines import EpisodeEngines
from stacx.rollout.asynchronous.async_rollout import AsyncRollout, importance_weight_metrics
from stacx.rollout.engine_health import EnginesBehind
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.evaluation import RolloutDumper
from stacx.rollout.rewards import resolve_reward_fn
from stacx.rollout.service import RolloutService
from stacx.rollout.step_rollout import StepRollout, uniform_reward_warning
from stacx.trainer.batch import StepBatch, StepDataSource
from stacx.trainer.config.recipe import TrainingConfig
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.rollout_dump import RolloutReplay
from stacx.trainer.session_recorder import session_endpoint

logger = logging.getLogger(__name__)


class SampleSource(Protocol):
    """What the loop asks of where its samples come from (module doc)."""

    step_rollout: Optional[Any]
    """The driver's step rollout (`StepRollout` or `AgentRollout`): eval, rollout summaries, the heartbeat's
    detail; None when nothing is generated (a dataset recipe without eval, a rank that is not the driver)."""
    phase: str
    """The heartbeat's name of the collecting phase ('rollout' or 'batch')."""

    def start(self, version: int) -> None:
        """Begin producing for the weights of `version` (the step the run starts at); no-op when sync."""

    def collect(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        """The batch of rollout step `step` and its rollout metrics (on the driver)."""

    def trained_batch_metrics(self, batch: StepBatch) -> dict[str, float]:
        """Metrics of the batch once its forward fields (pi_old) are filled; {} for on-policy sources."""

    def evaluate_if_due(self, completed_steps: int) -> dict[str, float]:
        """eval/* of the model after `completed_steps` rollout steps when due, else {}."""

    def begin_update(self) -> None:
        """A weight push starts (async: abort or drain what runs on the engine); no-op when sync."""

    def publish_version(self, version: int) -> None:
        """The engine serves `version` (async: admission reopens); no-op when sync."""

    def state_dict(self) -> dict[str, Any]:
        """The driver-state entries of a checkpoint: 'data' (the data position) and, async, 'async'."""

    def load_state_dict(self, driver_state: dict[str, Any]) -> None:
        """Resume from a checkpoint's driver state (before `start`)."""

    def close(self) -> None:
        """Stop producing (async: abort the in-flight requests); idempotent."""

    @property
    def waiting_for(self) -> Optional[str]:
        """What the collecting phase waits for, for the heartbeat (an agent's running episodes), or None."""


class _SyncSource:
    """The hooks a synchronous source leaves as they are, and eval through its step rollout."""

    step_rollout: Optional[Any] = None
    phase = "rollout"

    def start(self, version: int) -> None:
        pass

    def trained_batch_metrics(self, batch: StepBatch) -> dict[str, float]:
        return {}

    def evaluate_if_due(self, completed_steps: int) -> dict[str, float]:
        return self.step_rollout.evaluate_if_due(completed_steps) if self.step_rollout is not None else {}

    def begin_update(self) -> None:
        pass

    def publish_version(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def waiting_for(self) -> Optional[str]:
        # Only an agent's sessions report what they wait for (AgentRollout.waiting_for).
        return self.step_rollout.waiting_for if isinstance(self.step_rollout, AgentRollout) else None


class NoSamples(_SyncSource):
    """A rank that is not the driver: it collects nothing (the driver shares its batch)."""

    def __init__(self, *, off_policy_algorithm: Optional[AlgorithmConfig] = None):
        """off_policy_algorithm: the driver's source is asynchronous, so the trained batch's importance-weight
        metrics (at this algorithm's `tis_threshold`) are computed here too: every rank returns the same metrics."""
        self.off_policy_algorithm = off_policy_algorithm

    def collect(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        raise RuntimeError("only the driver collects samples; this rank receives its batch over the channel")

    def trained_batch_metrics(self, batch: StepBatch) -> dict[str, float]:
        if self.off_policy_algorithm is None:
            return {}
        return _importance_weight_metrics(batch, self.off_policy_algorithm)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, driver_state: dict[str, Any]) -> None:
        pass


class ReplaySamples(NoSamples):
    """The driver's source of a --replay-rollouts run: each step's batch read from the dump
    (stacx.trainer.rollout_dump); like a non-driver rank's source otherwise (no state to checkpoint)."""

    phase = "batch"

    def __init__(self, replay: RolloutReplay, *, off_policy_algorithm: Optional[AlgorithmConfig] = None):
        super().__init__(off_policy_algorithm=off_policy_algorithm)
        self.replay = replay

    def collect(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        return self.replay.read(step)


class DatasetSamples(_SyncSource):
    """A fixed dataset's next batch each step (SFT and DPO recipes, replayed trajectories)."""

    def __init__(self, data: StepDataSource, *, phase: str = "batch", step_rollout: Optional[Any] = None):
        self.data = data
        self.phase = phase
        self.step_rollout = step_rollout

    def collect(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        batch = self.data.next_dataset_batch()
        lengths = batch.response_lengths
        return batch, {"data/response_length_mean": sum(lengths) / len(lengths)}

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict()}

    def load_state_dict(self, driver_state: dict[str, Any]) -> None:
        if driver_state.get("data"):
            self.data.load_state_dict(driver_state["data"])


class RolloutSamples(_SyncSource):
    """One synchronous rollout per step through the driver's step rollout (or an agent's sessions)."""

    def __init__(self, step_rollout: Any, data: Optional[StepDataSource], *, run_config: RunConfig,
                 algorithm: AlgorithmConfig):
        """step_rollout: anything with `collect(step)` and `evaluate_if_due(step)`; data: where its prompts
        come from (None when it draws its own tasks), whose position a checkpoint saves."""
        self.step_rollout = step_rollout
        self.data = data
        self.run_config = run_config
        self.algorithm = algorithm

    def collect(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        """The step's samples. A rollout stopped by restarted engines that need the current weights
        (`EnginesBehind`) leaves the data where the step began: after the trainer's refresh push the step
        replays its own prompts (its sampling seeds are the step's already), so the data order and a resume
        stay exactly an uninterrupted run's."""
        start = self.data.state_dict() if self.data is not None else None
        try:
            samples, metrics = self.step_rollout.collect(step)
        except EnginesBehind:
            if start is not None:
                self.data.load_state_dict(start)
            raise
        self.last_samples = samples  # their weight versions go into --dump-rollouts (stacx.trainer.rollout_dump)
        return rollout_batch(samples, metrics, run_config=self.run_config, algorithm=self.algorithm)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict() if self.data is not None else {}}

    def load_state_dict(self, driver_state: dict[str, Any]) -> None:
        if self.data is not None and driver_state.get("data"):
            self.data.load_state_dict(driver_state["data"])


class AsyncRolloutSamples(RolloutSamples):
    """--rollout-mode async: a producer thread generates while the trainer trains; each step takes the
    scheduler's batch, and a weight push brackets the engine's update window."""

    def __init__(self, rollout: RolloutService, data: StepDataSource, step_rollout: StepRollout, *,
                 run_config: RunConfig, algorithm: AlgorithmConfig):
        super().__init__(step_rollout, data, run_config=run_config, algorithm=algorithm)
        self.rollout = rollout
        self.async_rollout: Optional[AsyncRollout] = None
        """The producer thread and scheduler (`start`)."""
        self._resume_state: dict = {}

    def start(self, version: int) -> None:
        """Start the producer at `version`, so that it generates while the trainer trains; the in-flight
        groups of a checkpoint are regenerated."""
        self.async_rollout = AsyncRollout(self.rollout, self.data, self.step_rollout,
                                          rollout_section=self.run_config.rollout, start_version=version,
                                          resume_state=self._resume_state)
        self.async_rollout.start()

    def collect(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        samples, metrics = self.async_rollout.take_batch(step)
        self.step_rollout.summarize(step, samples, metrics)
        self.last_samples = samples  # their per-token versions go into --dump-rollouts (stacx.trainer.rollout_dump)
        return rollout_batch(samples, metrics, run_config=self.run_config, algorithm=self.algorithm)

    def trained_batch_metrics(self, batch: StepBatch) -> dict[str, float]:
        return _importance_weight_metrics(batch, self.algorithm)

    def begin_update(self) -> None:
        if self.async_rollout is not None:
            self.async_rollout.begin_update()

    def publish_version(self, version: int) -> None:
        if self.async_rollout is not None:
            self.async_rollout.publish_version(version)

    def state_dict(self) -> dict[str, Any]:
        if self.async_rollout is None:
            return super().state_dict()
        data, generated = self.async_rollout.checkpoint_state()  # the generated, untrained groups: a resume trains them
        return {"data": data, "async": generated}

    def load_state_dict(self, driver_state: dict[str, Any]) -> None:
        super().load_state_dict(driver_state)
        self._resume_state = driver_state.get("async") or {}

    def close(self) -> None:
        if self.async_rollout is not None:
            async_rollout, self.async_rollout = self.async_rollout, None
            async_rollout.close()


def _importance_weight_metrics(batch: StepBatch, algorithm: AlgorithmConfig) -> dict[str, float]:
    if batch.log_probs is None or batch.rollout_log_probs is None:
        return {}
    return importance_weight_metrics(batch.log_probs, batch.rollout_log_probs, batch.loss_masks,
                                     threshold=float(algorithm.tis_threshold))


def rollout_batch(samples, metrics: dict[str, float], *, run_config: RunConfig,
                  algorithm: AlgorithmConfig) -> tuple[StepBatch, dict[str, float]]:
    """The StepBatch of a rollout's samples: routing replay checked, rewards shaped (opd_rl), and the
    teacher's mean log-prob over student-executed tokens added to `metrics`."""
    batch = StepBatch.from_samples(samples)
    if run_config.rollout.use_routing_replay and batch.routed_experts is None:
        raise ValueError("--use-routing-replay: the rollout returned no routed experts (multi-turn environment "
                         "episodes, DAgger roll-ins and --agent rollouts do not carry them yet); drop the flag")
    batch.rewards = shaped_rewards(batch, algorithm)
    if batch.teacher_log_probs is not None:  # over student-executed tokens (teacher ones hold the +1.0 sentinel)
        metrics["rollout/teacher_log_prob_mean"] = _masked_mean(
            batch.teacher_log_probs, [m * (t <= 0) for t, m in zip(batch.teacher_log_probs, batch.loss_masks)])
    return batch, metrics


def shaped_rewards(batch: StepBatch, algorithm: AlgorithmConfig) -> list[float]:
    """opd_rl: R_i - teacher_kl_coef * sum_t m_it (log pi(a_t) - log pi_teacher(a_t)) (rollout log-probs)."""
    rewards = list(batch.rewards)
    coef = algorithm.teacher_kl_coef
    if coef == 0.0 or batch.teacher_log_probs is None:
        return rewards
    return [
        r - coef * float(((lp - tlp) * m).sum())
        for r, lp, tlp, m in zip(rewards, batch.rollout_log_probs, batch.teacher_log_probs, batch.loss_masks)
    ]


def _masked_mean(values, masks) -> float:
    total = sum(float((v * (m != 0)).sum()) for v, m in zip(values, masks))
    count = sum(float((m != 0).sum()) for m in masks)
    return total / count if count else 0.0


# ---- choosing the source, once ---------------------------------------------------------------------


def choose_sample_source(*, run_config: RunConfig, training_config: TrainingConfig, algorithm: AlgorithmConfig,
                         data: Optional[StepDataSource], rollout: Optional[RolloutService], is_driver: bool,
                         step_rollout: Optional[Any] = None) -> SampleSource:
    """The run's one sample source (module doc). step_rollout: where the driver's samples come from instead
    of a StepRollout over `rollout` and `data` (an external agent's sessions); it needs --rollout-mode sync."""
    asynchronous = run_config.rollout.rollout_mode == "async"
    if step_rollout is not None and asynchronous:
        raise ValueError("--rollout-mode async draws its own prompts; a given step_rollout (an agent's sessions) "
                         "needs --rollout-mode sync")
    if not is_driver:
        return NoSamples(off_policy_algorithm=algorithm if asynchronous else None)
    if run_config.train.replay_rollouts:  # the dump's batches: no engine, data or reward
        return ReplaySamples(RolloutReplay(run_config.train.replay_rollouts, recipe=training_config.name),
                             off_policy_algorithm=algorithm if asynchronous else None)
    if step_rollout is None and rollout is not None:
        step_rollout = build_step_rollout(run_config, training_config, algorithm, rollout, data)
    phase = "rollout" if training_config.data_source == "rollout" else "batch"
    if training_config.data_source == "dataset" or (data is not None and data.kind == "trajectory"):
        return DatasetSamples(data, phase=phase, step_rollout=step_rollout)
    if asynchronous and step_rollout is not None:
        return AsyncRolloutSamples(rollout, data, step_rollout, run_config=run_config, algorithm=algorithm)
    return RolloutSamples(step_rollout, data, run_config=run_config, algorithm=algorithm)


def build_step_rollout(run_config: RunConfig, training_config: TrainingConfig, algorithm: AlgorithmConfig,
                       rollout: RolloutService, data: Optional[StepDataSource]):
    """The driver's `StepRollout` (roll-ins, DAPO shaping and sampling, eval, rollout dumps), or with
    --agent / --agent-command the agent's sessions (`build_agent_rollout`)."""
    section = run_config.rollout
    if section.agent or section.agent_command:
        return build_agent_rollout(run_config, algorithm, rollout, data)
    return StepRollout(rollout, data, rollout=section, plan=rollout_plan(training_config, run_config),
                       algorithm=algorithm, out_dir=run_config.logging.out)


def build_agent_rollout(run_config: RunConfig, algorithm: AlgorithmConfig, rollout: RolloutService,
                        data: StepDataSource) -> AgentRollout:
    """--agent / --agent-command: each prompt row is a task the user's agent runs n_samples_per_prompt
    times against the engine's OpenAI-compatible endpoint; its recorded turns are the samples."""
    section, tokenizer = run_config.rollout, rollout.tokenizer

    def next_tasks(step: int, count: Optional[int] = None) -> list[dict]:
        """`count` prompt rows as tasks (default: a step's batch); more replace groups that lost an episode."""
        return [{"prompt": tokenizer.decode(example.prompt_ids), "label": example.label,
                 "metadata": dict(example.metadata), "source": example.source}
                for example in data.next_examples(count or data.batch_size)]

    def uniform_rewards(step: int, samples) -> Optional[str]:
        if algorithm.advantage_estimator == "gae":  # a critic's advantages are not 0 then
            return None
        return uniform_reward_warning(step, samples, n_samples_per_prompt=section.n_samples_per_prompt,
                                      temperature=section.rollout_temperature, reward_fn=section.reward_fn)

    dumper = (RolloutDumper(run_config.logging.out, per_step=section.save_rollouts_per_step, tokenizer=tokenizer)
              if section.save_rollouts_per_step > 0 else None)
    agent = agent_from_settings(section.agent, section.agent_command, agent_timeout=section.agent_timeout,
                                agent_env=section.agent_env)
    kind = resolve_engine_kind(rollout.engine_kind)
    endpoint = session_endpoint(kind, rollout, model_path=run_config.model.hf_checkpoint or "")
    return AgentRollout(agent, server_url=endpoint.url,
                        next_tasks=next_tasks, n_samples_per_task=section.n_samples_per_prompt,
                        reward_fn=last_turn_reward(resolve_reward_fn(section.reward_fn), tokenizer.decode),
                        max_parallel_episodes=section.agent_max_parallel_episodes, api_key=endpoint.api_key,
                        dumper=dumper, uniform_reward_warning=uniform_rewards,
                        episode_retries=section.episode_retries, max_dropped_fraction=section.max_dropped_fraction,
                        more_tasks=next_tasks,
                        engines=episode_engines(kind, rollout))


def episode_engines(kind, rollout: RolloutService) -> Optional[EpisodeEngines]:
    """Where an agent run's episodes open their sessions, engine by engine: each on a live engine of the supervised
    pool, moved when it fails, when `kind` records sessions itself (`stacx serve`); None (every episode on the one
    session endpoint) otherwise: an engine that records none (vLLM) is reached through the recorder in front of the
    driver's engine client (stacx.trainer.session_recorder), and its own URL answers no session call."""
    if rollout.supervisor is None or not kind.records_sessions:
        return None
    return EpisodeEngines(rollout.engine)
