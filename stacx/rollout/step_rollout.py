"""One step's samples on the driver: roll-in or plain sampling, DAPO's reward shaping and
dynamic sampling, rollout dumps; held-out evaluation every `eval_interval` steps.

    step_rollout = StepRollout(service, data, rollout=run_config.rollout, plan=plan, algorithm=..., out_dir=...)
    samples, metrics = step_rollout.collect(step)       # rewards and teacher fields filled
    metrics.update(step_rollout.evaluate_if_due(step))  # the model after `step` steps, before step `step`

DAPO (the `dapo` recipe's algorithm overrides, or the flags):
- overlong penalty, with L = rollout_max_response_len, B = overlong_buffer_length, f = overlong_penalty_factor
  and n the response length:   r += 0                      if n <= L - B
                               r += (L - B - n) / B * f    if L - B < n <= L     (from 0 down to -f)
  applied before dynamic sampling, so a group that differs only by the penalty is informative;
- dynamic sampling (`filter_zero_variance_groups`, or `dynamic_sampling`): groups whose rewards are
  all equal are dropped and more prompts are drawn (over_sampling_factor x the missing count per
  round, at most DYNAMIC_SAMPLING_MAX_ROUNDS rounds) until rollout_batch_size groups remain.
  Logged: rollout/dynamic_groups_drawn, _kept, _dropped (uniform), _surplus (informative groups of
  the last round beyond the batch, discarded), rollout/dynamic_rounds.

Every step writes its first `save_rollouts_per_step` samples to <out>/rollouts.jsonl.

The first step whose groups each hold identical rewards (so a group-relative advantage, and with
it the policy loss, is 0 for every sample) is warned about once, with the likely causes
(`uniform_reward_warning`): a model that never earns a reward, too few or too similar samples, or
a reward function that gives everyone the same score.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any, Optional, Sequence, TYPE_CHECKING

from stacx.objectives.algorithm_config import AlgorithmConfig, as_algorithm_config
from stacx.rollout import rollin
from stacx.rollout.agents.episode import episode_metrics
from stacx.rollout.episode_retry import DROPPED_KEY, replace_dropped_groups, retry_failed
from stacx.rollout.data import DataConfig, ExampleSource, load_examples
from stacx.rollout.dynamic_sampling import collect_informative_groups
from stacx.rollout.evaluation import RolloutDumper, evaluate
from stacx.rollout.plan import RolloutPlan
from stacx.rollout.sections import RolloutSection
from stacx.wire.sample import Executor

if TYPE_CHECKING:  # annotations only
    from stacx.rollout.service import RolloutService

logger = logging.getLogger(__name__)

DYNAMIC_SAMPLING_MAX_ROUNDS = 8
"""Draw rounds before dynamic sampling gives up with the counts (every group degenerate)."""


def overlong_buffer_tokens(algorithm: AlgorithmConfig, max_response_len: int) -> int:
    """B in tokens: overlong_buffer_length when given, else overlong_buffer_fraction * L, else 0 (off)."""
    if algorithm.overlong_buffer_length is not None:
        return algorithm.overlong_buffer_length
    fraction = algorithm.overlong_buffer_fraction
    return int(round(fraction * max_response_len)) if fraction else 0


def overlong_penalty(response_length: int, *, max_length: int, buffer_length: int, factor: float) -> float:
    """DAPO's soft overlong punishment (formula in the module doc); 0 when the buffer is off."""
    if not buffer_length:
        return 0.0
    if buffer_length < 0 or buffer_length > max_length:
        raise ValueError(f"overlong_buffer_length must be in [0, rollout_max_response_len={max_length}], "
                         f"got {buffer_length}")
    free = max_length - buffer_length
    if response_length <= free:
        return 0.0
    return max(free - response_length, -buffer_length) / buffer_length * factor


def dynamic_sampling_enabled(rollout: RolloutSection, algorithm: AlgorithmConfig) -> bool:
    return rollout.dynamic_sampling or algorithm.filter_zero_variance_groups


def split_groups(samples: Sequence[Any]) -> list[list[Any]]:
    """Samples grouped by group_index, in first-seen order."""
    groups: dict[int, list] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


class StepRollout:
    """The driver's per-step sample producer (built once per run)."""

    def __init__(self, service: RolloutService, data: Optional[ExampleSource], *, rollout: RolloutSection,
                 plan: RolloutPlan, algorithm: AlgorithmConfig, out_dir: str):
        """rollout: the run's rollout section; plan: the recipe's view (the trainer's `rollout_plan`);
        out_dir: where rollouts.jsonl is written (--out)."""
        if plan.rollin is None:
            raise ValueError(f"recipe {plan.recipe!r}: this run replays a teacher trajectory corpus "
                             "(dagger_sft_mode 'trajectory') and samples no rollouts")
        self.service = service
        self.data = data
        self.rollout = rollout
        self.plan = plan
        self.algorithm = algorithm = as_algorithm_config(algorithm, "StepRollout(algorithm=...)")
        self.spec = plan.rollin
        self.dynamic = dynamic_sampling_enabled(rollout, algorithm)
        self.overlong_buffer = overlong_buffer_tokens(algorithm, rollout.rollout_max_response_len)
        self.overlong_factor = algorithm.overlong_penalty_factor
        if self.overlong_buffer > rollout.rollout_max_response_len or self.overlong_buffer < 0:
            # Fail at start, not mid-run.
            raise ValueError(
                f"recipe {plan.recipe!r}: overlong_buffer_length={self.overlong_buffer} must be in "
                f"[0, rollout_max_response_len={rollout.rollout_max_response_len}]; set --overlong-buffer-length "
                f"(DAPO uses a fifth of the limit, here {rollout.rollout_max_response_len // 5}) or raise "
                "--rollout-max-response-len")
        self.dumper = None
        if rollout.save_rollouts_per_step > 0:
            self.dumper = RolloutDumper(out_dir, per_step=rollout.save_rollouts_per_step,
                                        tokenizer=service.tokenizer)
        self.eval_examples = self._load_eval_examples()
        self.warned_uniform_rewards = False

    # ---- the step's samples ----------------------------------------------------------------

    def collect(self, step: int) -> tuple[list, dict[str, float]]:
        """(samples with rewards and teacher fields, rollout metrics) of training step `step`."""
        manager = self.service.manager(step)
        rng = random.Random(self.rollout.rollout_seed * 1_000_003 + step)
        metrics: dict[str, float] = {}
        batch_size = self.data.batch_size

        def play(num_prompts: int) -> list:
            return self.generate(manager, self.data.next_examples(num_prompts), step, rng, metrics)

        def draw(num_prompts: int) -> list:
            """num_prompts complete groups: a group with a dropped episode is replaced (stacx.rollout.episode_retry)."""
            samples, counts = replace_dropped_groups(play(num_prompts), play, num_groups=num_prompts, step=step,
                                                     max_dropped_fraction=self.rollout.max_dropped_fraction)
            for name, value in counts.items():
                metrics[name] = metrics.get(name, 0.0) + value
            return samples

        if self.dynamic:
            result = collect_informative_groups(
                lambda k: split_groups(draw(k)), lambda group: [s.reward for s in group], target_groups=batch_size,
                over_sampling_factor=self.rollout.over_sampling_factor,
                max_rounds=DYNAMIC_SAMPLING_MAX_ROUNDS)
            samples = []
            for index, group in enumerate(result.groups):
                for sample in group:
                    sample.group_index = index
                    samples.append(sample)
            metrics.update({"rollout/dynamic_groups_drawn": float(result.num_drawn),
                            "rollout/dynamic_groups_kept": float(len(result.groups)),
                            "rollout/dynamic_groups_dropped": float(result.num_dropped),
                            # informative groups drawn beyond the batch in the last round (discarded)
                            "rollout/dynamic_groups_surplus": float(result.num_drawn - result.num_dropped
                                                                    - len(result.groups)),
                            "rollout/dynamic_rounds": float(result.num_rounds)})
        else:
            samples = draw(batch_size)
        self.summarize(step, samples, metrics)
        return samples, metrics

    def summarize(self, step: int, samples: Sequence[Any], metrics: dict[str, float]) -> None:
        """The step's sample metrics into `metrics`, the uniform-reward warning and the rollout dump
        (also for the batches of an asynchronous rollout)."""
        metrics.update(sample_metrics(samples))
        self.warn_if_rewards_are_uniform(step, samples)
        for index, count in enumerate(getattr(self.service.engine, "requests_sent", ())):
            metrics[f"rollout/engine{index}_requests"] = float(count)  # cumulative, per rollout engine
        if self.dumper is not None:
            self.dumper.write(step, samples)

    def generate(self, manager, examples: Sequence[Any], step: int, rng: random.Random, metrics: dict) -> list:
        """Samples of `examples` (rewards, overlong penalty, teacher fields); roll-in metrics into `metrics`."""
        rollout = self.rollout
        if self.spec.mode == "student" and not any(rollin.has_environment(e) for e in examples):
            samples = manager.generate([e.prompt_ids for e in examples], self.service.sampling_params(),
                                       n_samples_per_prompt=rollout.n_samples_per_prompt,
                                       labels=[e.label for e in examples], metadatas=[e.metadata for e in examples])
        else:
            samples = self.roll_in(manager, examples, step, rng, metrics)
        self.apply_overlong_penalty(samples)
        return samples

    def roll_in(self, manager, examples: Sequence[Any], step: int, rng: random.Random, metrics: dict) -> list:
        tokenizer = self.service.tokenizer
        sampling = self.service.sampling_params()
        episodes = rollin.start_episodes(examples, n_samples_per_prompt=self.rollout.n_samples_per_prompt,
                                         spec=self.spec, iteration=step, rng=rng, tokenizer=tokenizer)
        engines = {Executor.STUDENT: self.service.engine}
        if self.spec.uses_teacher_engine:
            engines[Executor.TEACHER] = self.service.teacher_engine()
        rollin.run_turns(episodes, engines=engines, sampling=sampling, tokenizer=tokenizer, rng=rng)

        episodes, retried = retry_failed(
            episodes, failure=lambda e: e.failure, retries=self.rollout.episode_retries,
            replay=lambda failed: rollin.replay_episodes(failed, spec=self.spec, iteration=step, engines=engines,
                                                         sampling=sampling, tokenizer=tokenizer, rng=rng))
        metrics["rollout/episodes_retried"] = metrics.get("rollout/episodes_retried", 0.0) + retried
        for episode in episodes:
            if episode.failure:
                episode.sample.metadata[DROPPED_KEY] = episode.failure
        samples = [e.sample for e in episodes]
        versions = [v for e in episodes for v in e.student_versions]
        for episode in episodes:
            episode.sample.weight_version = min(episode.student_versions, default=min(versions, default=0))
        manager.decode(samples)
        single_turn = [e.sample for e in episodes if e.session is None]
        manager.score_rewards(single_turn)  # an environment's episodes carry the sum of its step rewards
        metrics.update(rollin.rollin_metrics(self.spec, episodes, step))
        metrics.update(episode_metrics(samples))
        if self.spec.mode == "relabel":
            samples = rollin.relabel_with_teacher(episodes, teacher_engine=engines[Executor.TEACHER],
                                                  sampling=sampling, tokenizer=tokenizer, rng=rng)
            metrics["rollin/relabeled_samples"] = float(len(samples))
        elif self.plan.uses_teacher:
            manager.score_with_teacher(samples)
        return samples

    def apply_overlong_penalty(self, samples: Sequence[Any]) -> None:
        if not self.overlong_buffer:
            return
        for sample in samples:
            penalty = overlong_penalty(sample.response_length, max_length=self.rollout.rollout_max_response_len,
                                       buffer_length=self.overlong_buffer, factor=self.overlong_factor)
            sample.metadata["overlong_penalty"] = penalty
            sample.reward = (sample.reward if sample.reward is not None else 0.0) + penalty

    def warn_if_rewards_are_uniform(self, step: int, samples: Sequence[Any]) -> None:
        """Log `uniform_reward_warning` once per run, at the first step where it applies.

        Only for reward recipes without a critic: GAE's advantages come from the value model and are
        not zero when the rewards of a group agree."""
        if self.warned_uniform_rewards or not self.plan.uses_reward:
            return
        if self.algorithm.advantage_estimator == "gae":
            return
        message = uniform_reward_warning(step, samples,
                                         n_samples_per_prompt=self.rollout.n_samples_per_prompt,
                                         temperature=self.rollout.rollout_temperature,
                                         reward_fn=self.rollout.reward_fn)
        if message is not None:
            self.warned_uniform_rewards = True
            logger.warning(message)

    # ---- evaluation --------------------------------------------------------------------------

    def _load_eval_examples(self) -> Optional[list]:
        rollout = self.rollout
        if rollout.eval_interval < 0:
            raise ValueError(f"eval_interval must be >= 0, got {rollout.eval_interval}")
        if rollout.eval_interval == 0:
            if rollout.eval_data:
                logger.warning("eval_data is set but eval_interval is 0: no evaluation will run")
            return None
        if not rollout.eval_data:
            raise ValueError(f"eval_interval={rollout.eval_interval} needs --eval-data (held-out prompts)")
        if rollout.eval_n_samples < 1:
            raise ValueError(f"eval_n_samples must be >= 1, got {rollout.eval_n_samples}")

        config = DataConfig(path=rollout.eval_data, kind="prompt", input_key=rollout.input_key,
                            label_key=rollout.label_key, metadata_key=rollout.metadata_key,
                            apply_chat_template=rollout.apply_chat_template, malformed_rows=rollout.malformed_rows)
        return load_examples(config, self.service.tokenizer)

    def evaluate_if_due(self, completed_steps: int) -> dict[str, float]:
        """eval/mean_reward, eval/pass@1, eval/pass@<n>, eval/reward_errors of the model the engine
        serves after `completed_steps` training steps, when that is a multiple of eval_interval
        (0 included: the starting model); else {}. The loop logs them at step `completed_steps`."""
        rollout = self.rollout
        if self.eval_examples is None or completed_steps % rollout.eval_interval:
            return {}
        manager = self.service.manager(completed_steps, seed_offset=EVAL_SEED_OFFSET, with_teacher=False)
        sampling = dataclasses.replace(self.service.sampling_params(), temperature=rollout.eval_temperature)
        return evaluate(manager, self.eval_examples, sampling, n_samples=rollout.eval_n_samples, prefix="eval")


EVAL_SEED_OFFSET = 7_919
"""Keeps evaluation's sampling seeds apart from the training rollouts' of the same step."""


def sample_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """Reward, length, weight-version and reward-error summaries of a step's samples."""
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    lengths = [s.response_length for s in samples]
    return {
        "rollout/reward_mean": sum(rewards) / len(rewards),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/weight_version": float(min(s.weight_version for s in samples)),
        "rollout/reward_errors": float(sum(s.reward_error is not None for s in samples)),
        "rollout/num_samples": float(len(samples)),
    }


def uniform_reward_warning(step: int, samples: Sequence[Any], *, n_samples_per_prompt: int, temperature: float,
                           reward_fn: str) -> Optional[str]:
    """The warning when every group's rewards are identical, else None.

    A group-relative advantage is A_i = (r_i - mean_group(r)) [/ std], so a group whose rewards are all
    equal gives A_i = 0 to each of its samples; when that holds for every group the policy loss and its
    gradient are 0 and the step leaves the model unchanged."""
    groups = split_groups(samples)
    rewards = [[s.reward if s.reward is not None else 0.0 for s in group] for group in groups]
    if not groups or any(max(group) != min(group) for group in rewards):
        return None
    values = sorted({group[0] for group in rewards})
    shown = ", ".join(f"{value:g}" for value in values[:3]) + (", ..." if len(values) > 3 else "")
    return (f"stacx train: warning: step {step}: every group's rewards are identical (reward {shown} within each "
            f"of {len(groups)} groups), so every advantage and the policy loss are 0 and this step does not change "
            "the model. Likely causes: a model that never earns a reward (start from an SFT or instruction-tuned "
            f"checkpoint, not a random one), too few or too similar samples (raise --n-samples-per-prompt, now "
            f"{n_samples_per_prompt}, or --rollout-temperature, now {temperature:g}), or " + _reward_source(samples, reward_fn))


def _reward_source(samples: Sequence[Any], reward_fn: str) -> str:
    """What scores these samples, for the uniform-reward warning: an environment's episodes are scored by
    the environment (its tools and its final check), other samples by --reward-fn."""
    metadatas = [s.metadata for s in samples if isinstance(getattr(s, "metadata", None), dict)]
    if any("session_id" in m for m in metadatas):  # stacx.rollout.agents.agent_rollout: an external agent's episodes
        return (f"an agent whose episodes all earn the same reward (check the reward --agent / --agent-command "
                f"returns, or --reward-fn {reward_fn} when it returns none, on a few tasks; rollouts.jsonl holds "
                "every dumped episode's turns)")
    environments = sorted({str(m["environment"]) for m in metadatas if m.get("environment")})
    if environments or any("episode" in m for m in metadatas):
        named = ", ".join(environments) or "the environment"
        return (f"an environment that scores every episode the same (check what {named} rewards, and that the "
                "model's replies reach its tools: the agent/parse_errors and agent/tool_calls metrics)")
    return (f"a reward function that scores every answer the same (check --reward-fn {reward_fn} on a few rows, "
            "e.g. with `stacx eval`)")
