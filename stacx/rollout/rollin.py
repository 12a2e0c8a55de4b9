"""Live roll-ins for the training loop: who acts in each turn, batched over a step's episodes.

An episode is one sample: a prompt, then turns. A turn is one model action (generated until eos
or `rollout_max_response_len` tokens). A prompt row whose metadata names an environment plays a
multi-turn episode (the row names it, as agent datasets do, so one dataset may mix tasks):

    {"prompt": "...", "label": ..., "metadata": {"environment": "guess_number", "max_turns": 3, "target": 4}}

`environment` is a registered name (`guess_number`, `calculator`, or one `@register_environment`
adds from a `--custom-module` file or `stacx/custom/`) or 'module:Class' of a
`stacx.rollout.agents.environments.Environment`; the rest of the metadata, plus `label`, is the task
given to `reset`. The environment's observation follows each action, up to `max_turns` actions
(default DEFAULT_MAX_TURNS); each episode's environment side is an `AgentSession`
(`stacx.rollout.agents.episode`: tools, token-in/token-out). Without an environment an episode is the
single turn answering the dataset prompt.

Who executes turn t comes from a roll-in plan (stacx.rollout.dagger), drawn per episode:
- `mixture_dagger_opd` (mode 'beta'): each turn the teacher acts with probability beta(i),
  i = the training step;
- `mixture_aggrevate_opd` (mode 'kappa'): kappa ~ U{0..T_max(i)}; the student acts in turns
  0..kappa-1, the teacher force-decodes every later turn;
- `online_dagger` live: the DAgger mixture pi_i = beta_i pi_teacher + (1 - beta_i) pi_student
  picks the executed actions (beta schedule), and the teacher relabels every visited state: each
  turn t becomes one SFT sample `(tokens before turn t, the teacher's action there)`.
- any other rollout recipe: the student acts in every turn.
`STACX_DAGGER_SAMPLING_MODE` overrides the mode; otherwise a `dagger_sampling_mode` the user set
(recorded in `RunConfig.given_keys`, whatever its value) wins, else the recipe's protocol decides.

Turns are generated in lock-step: at turn t every unfinished episode sends one request, grouped
by executor, the student's batch to the rollout engine and the teacher's to the teacher engine
concurrently. Each token records its executor (0 environment, 1 student, 2 teacher); teacher
tokens carry rollout log-prob 0.0 (the trainer recomputes the student's) and, after teacher
scoring, the +1.0 sentinel in `teacher_log_probs`.
"""

from __future__ import annotations

import dataclasses
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from stacx.env_overrides import apply_env_overrides, read_env_overrides
from stacx.rollout.agents.environments import check_task, resolve_environment
from stacx.rollout.agents.episode import AgentSession, append_action
from stacx.rollout.dagger import AggreVaTeRollIn, BetaMixtureRollIn, BetaSchedule, KappaPlan, build_roll_in
from stacx.rollout.episode_retry import infrastructure_cause
from stacx.rollout.sections import TeacherSection
from stacx.wire.sample import Executor, Sample
from stacx.wire.trajectories import append_template, empty_sample
from stacx.wire.types import GenerateRequest, SamplingParams

RECIPE_SAMPLING_MODES = {"beta_mixture": "beta", "aggrevate": "kappa"}
"""rollin_protocol of a recipe -> the dagger_sampling_mode it runs by default."""
DEFAULT_SAMPLING_MODE = "beta"
ENVIRONMENT_KEY, MAX_TURNS_KEY, TOOL_CALL_STYLE_KEY = "environment", "max_turns", "tool_call_style"
"""Metadata keys of a prompt row that make it a multi-turn episode (the rest is the task)."""
DEFAULT_MAX_TURNS = 4
MAX_CONCURRENT_ENVIRONMENT_STEPS = 64
"""Episodes whose tools (or `step`) run at the same time within one turn of a batched roll-in."""


@dataclass(frozen=True)
class RollInSpec:
    """How a run's episodes are rolled in."""

    mode: str
    """'student' (no roll-in), 'beta', 'kappa' or 'relabel' (online_dagger live)."""
    roll_in: Any = None
    """BetaMixtureRollIn or AggreVaTeRollIn (None for 'student')."""

    @property
    def uses_teacher_engine(self) -> bool:
        return self.mode != "student"


def resolve_rollin(rollin_protocol: Optional[str], teacher_section: TeacherSection,
                   environ: Optional[Mapping[str, str]] = None, *, given_keys: frozenset[str] = frozenset(),
                   recipe: str = "") -> Optional[RollInSpec]:
    """The roll-in of a rollout run whose recipe has `rollin_protocol`, or None when the run replays a
    trajectory corpus instead. `given_keys` (RunConfig.given_keys) says whether the user set
    dagger_sampling_mode; `recipe` names the recipe in errors.

    Raises ValueError naming the field for a bad schedule or mode."""
    protocol = rollin_protocol
    teacher = apply_env_overrides(teacher_section, environ)
    if protocol is None:
        return RollInSpec("student")
    if protocol == "teacher_relabel":
        if teacher.dagger_sft_mode == "trajectory":
            return None
        if teacher.dagger_sft_mode != "live":
            raise ValueError(f"dagger_sft_mode: unknown {teacher.dagger_sft_mode!r}; known: ['live', 'trajectory']")
        schedule = BetaSchedule(kind=teacher.dagger_beta_schedule, start=teacher.dagger_beta_start,
                                end=teacher.dagger_beta_end, num_iters=teacher.dagger_beta_iters)
        return RollInSpec("relabel", BetaMixtureRollIn(schedule))
    if protocol not in RECIPE_SAMPLING_MODES:
        raise ValueError(f"recipe {recipe!r}: unknown rollin_protocol {protocol!r}")
    explicit = "dagger_sampling_mode" in read_env_overrides(environ) or "dagger_sampling_mode" in given_keys
    mode = teacher.dagger_sampling_mode if explicit else RECIPE_SAMPLING_MODES[protocol]
    return RollInSpec(mode, build_roll_in(dataclasses.replace(teacher, dagger_sampling_mode=mode)))


def has_environment(example) -> bool:
    return bool((example.metadata or {}).get(ENVIRONMENT_KEY))


@dataclass
class Turn:
    """One action inside an episode's response: tokens [start, end) of response_ids."""

    executor: Executor
    start: int
    end: int


@dataclass
class Episode:
    sample: Sample
    plan: Any
    session: Optional[AgentSession] = None
    """The environment side of a multi-turn episode (None: one turn answering the dataset prompt)."""
    max_turns: int = 1
    done: bool = False
    turns: list[Turn] = field(default_factory=list)
    kappa: Optional[int] = None
    student_versions: list[int] = field(default_factory=list)
    example: Any = None
    """The prompt row it plays (a retry plays it again)."""
    failure: Optional[str] = None
    """Why it failed for an infrastructure reason (stacx.rollout.episode_retry), None when it did not."""


def fail_episode(episode: Episode, error: BaseException) -> None:
    """End `episode` as failed for an infrastructure reason (its session closed, best effort)."""
    episode.failure = f"{infrastructure_cause(error)}: {type(error).__name__}: {error}"
    episode.done = True
    if episode.session is not None:
        try:
            episode.session.close()
        except Exception:  # noqa: BLE001 - the sandbox behind it may be gone
            pass


def start_episodes(examples: Sequence[Any], *, n_samples_per_prompt: int, spec: RollInSpec, iteration: int,
                   rng: random.Random, tokenizer) -> list[Episode]:
    """n episodes per example (prompt-major; group_index = the example's position), plans drawn now."""
    episodes: list[Episode] = []
    try:
        _start(episodes, examples, n_samples_per_prompt=n_samples_per_prompt, spec=spec, iteration=iteration, rng=rng,
               tokenizer=tokenizer)
    except BaseException:
        close_sessions(episodes)
        raise
    return episodes


def close_sessions(episodes: Sequence[Episode]) -> None:
    """End every episode's environment session (idempotent: a finished one is closed already)."""
    for episode in episodes:
        if episode.session is not None:
            episode.session.close()


def _start(episodes: list, examples, *, n_samples_per_prompt, spec, iteration, rng, tokenizer) -> None:
    for index, example in enumerate(examples):
        metadata = dict(example.metadata or {})
        for _ in range(n_samples_per_prompt):
            session, prompt, max_turns, failed = None, list(example.prompt_ids), 1, None
            if metadata.get(ENVIRONMENT_KEY):
                try:
                    session, max_turns = _start_session(example, metadata, rng=rng, tokenizer=tokenizer)
                    prompt = list(session.prompt_ids)
                except Exception as err:  # noqa: BLE001 - an infrastructure failure fails this episode only
                    if infrastructure_cause(err) is None:
                        raise
                    failed = err
            if spec.roll_in is None:
                plan, kappa = (lambda turn: Executor.STUDENT), None
            else:
                plan = spec.roll_in.plan(iteration, rng)
                kappa = plan.kappa if isinstance(plan, KappaPlan) else None
            sample = empty_sample(prompt, group_index=index, label=example.label,
                                  metadata={**metadata, "turn_executors": []})
            if kappa is not None:
                sample.metadata["kappa"] = kappa
            episodes.append(Episode(sample=sample, plan=plan, session=session, max_turns=max_turns, kappa=kappa,
                                    example=example))
            if failed is not None:
                fail_episode(episodes[-1], failed)


def _start_session(example, metadata: dict, *, rng: random.Random, tokenizer) -> tuple[AgentSession, int]:
    """The environment session a prompt row names, and its max_turns (ValueErrors name the row and field)."""
    where = f"prompt row {example.source}"
    environment_class = resolve_environment(str(metadata[ENVIRONMENT_KEY]), where=where)
    max_turns = int(metadata.get(MAX_TURNS_KEY, DEFAULT_MAX_TURNS))
    if max_turns < 1:
        raise ValueError(f"{where}: metadata {MAX_TURNS_KEY} must be >= 1, got {max_turns}")
    task = {k: v for k, v in metadata.items() if k not in (ENVIRONMENT_KEY, MAX_TURNS_KEY, TOOL_CALL_STYLE_KEY)}
    task["label"] = example.label
    check_task(environment_class, task, where=where)
    session = AgentSession(environment_class(), task, tokenizer=tokenizer, rng=rng,
                           tool_call_style=metadata.get(TOOL_CALL_STYLE_KEY))
    return session, max_turns


def _append_action(episode: Episode, executor: Executor, output, eos: int) -> None:
    """Add one turn's action as the engine generated it (`stacx.rollout.agents.episode.append_action`)."""
    start, end = append_action(episode.sample, executor, output, eos)
    episode.sample.finish_reason = output.finish_reason
    episode.turns.append(Turn(executor, start, end))
    if executor == Executor.STUDENT:
        episode.student_versions.append(output.weight_version)


def _append_observation(episode: Episode, result, turn: int) -> None:
    """The environment's `result` for the last action: its reward, and its observation ids unless the episode ends."""
    sample = episode.sample
    reply = episode.session.reply(result, last_turn=turn == episode.max_turns - 1)
    sample.reward = (sample.reward or 0.0) + reply.reward
    if reply.done or turn == episode.max_turns - 1:
        episode.done = True
        sample.finish_reason = "stop" if reply.done else "length"
        episode.session.record(sample)
        episode.session.close()
        return
    append_template(sample, reply.observation_ids)


def generate_grouped(engines: Mapping[Executor, Any], work: Mapping[Executor, list[GenerateRequest]]) -> dict:
    """Each executor's requests on its engine, the executors concurrently; {executor: outputs}."""
    missing = [e.name for e in work if e not in engines]
    if missing:
        raise ValueError(f"no engine for executor(s) {missing}; have {[e.name for e in engines]}")
    with ThreadPoolExecutor(max_workers=max(1, len(work))) as pool:
        futures = {executor: pool.submit(engines[executor].generate, requests) for executor, requests in work.items()}
        return {executor: future.result() for executor, future in futures.items()}


def run_turns(episodes: Sequence[Episode], *, engines: Mapping[Executor, Any], sampling: SamplingParams,
              tokenizer, rng: random.Random) -> None:
    """Play every episode to its end, turn by turn (one batched request per executor per turn); every
    environment session is closed when this returns or raises."""
    try:
        _run_turns(episodes, engines=engines, sampling=sampling, tokenizer=tokenizer, rng=rng)
    finally:
        close_sessions(episodes)


def _run_turns(episodes: Sequence[Episode], *, engines, sampling: SamplingParams, tokenizer, rng: random.Random) -> None:
    eos = tokenizer.eos_token_id
    for turn in range(max((e.max_turns for e in episodes), default=0)):
        active = [e for e in episodes if not e.done]
        if not active:
            return
        work: dict[Executor, list] = {}
        for episode in active:
            executor = Executor(episode.plan(turn))
            request = GenerateRequest(input_ids=tuple(episode.sample.tokens),
                                      sampling=dataclasses.replace(sampling, seed=rng.randrange(2**31)))
            work.setdefault(executor, []).append((episode, request))
        outputs = generate_grouped(engines, {ex: [r for _, r in items] for ex, items in work.items()})
        playing, replies = [], []
        for executor, items in work.items():
            for (episode, _), output in zip(items, outputs[executor]):
                _append_action(episode, executor, output, eos)
                if episode.session is None:
                    episode.done = True
                    continue
                last = episode.turns[-1]
                playing.append(episode)
                replies.append(episode.session.read(episode.sample.response_ids[last.start:last.end]))
        # The environments act concurrently (a slow or hanging tool delays its own episode only);
        # reading and tokenizing stay in this thread.
        with ThreadPoolExecutor(max_workers=max(1, min(MAX_CONCURRENT_ENVIRONMENT_STEPS, len(playing)))) as pool:
            results = list(pool.map(lambda pair: _act(*pair), zip(playing, replies)))
        for episode, result in zip(playing, results):
            if isinstance(result, BaseException):
                fail_episode(episode, result)
                continue
            _append_observation(episode, result, turn)


def replay_episodes(failed: Sequence[Episode], *, spec: RollInSpec, iteration: int, engines: Mapping[Executor, Any],
                    sampling: SamplingParams, tokenizer, rng: random.Random) -> list[Episode]:
    """Each failed episode played again from its prompt row, in its group (stacx.rollout.episode_retry)."""
    fresh = start_episodes([e.example for e in failed], n_samples_per_prompt=1, spec=spec, iteration=iteration,
                           rng=rng, tokenizer=tokenizer)
    for old, new in zip(failed, fresh):
        new.sample.group_index = old.sample.group_index
    run_turns(fresh, engines=engines, sampling=sampling, tokenizer=tokenizer, rng=rng)
    return fresh


def _act(episode: Episode, reply):
    """The environment's answer to `reply`, or the infrastructure error that failed the episode (other
    errors are raised)."""
    try:
        return episode.session.act(reply)
    except Exception as err:  # noqa: BLE001 - classified: only an infrastructure failure is contained
        if infrastructure_cause(err) is None:
            raise
        return err


def relabel_with_teacher(episodes: Sequence[Episode], *, teacher_engine, sampling: SamplingParams,
                         tokenizer, rng: random.Random) -> list[Sample]:
    """online_dagger: one SFT sample per visited turn, its response the teacher's action there.

    A teacher-executed turn is its own label; a student-executed turn's state is sent to the
    teacher (one batch). Loss mask 1 on the label's tokens (0 on an eos appended to close it)."""
    eos = tokenizer.eos_token_id
    labels: list[tuple[Episode, Turn, Optional[list[int]]]] = []
    requests = []
    for episode in episodes:
        for turn in episode.turns:
            if turn.executor == Executor.TEACHER:
                labels.append((episode, turn, episode.sample.response_ids[turn.start:turn.end]))
            else:
                labels.append((episode, turn, None))
                requests.append(GenerateRequest(
                    input_ids=tuple(episode.sample.prompt_ids + episode.sample.response_ids[:turn.start]),
                    sampling=dataclasses.replace(sampling, seed=rng.randrange(2**31))))
    answers = iter(teacher_engine.generate(requests) if requests else [])
    samples = []
    for turn_index, (episode, turn, action) in enumerate(labels):
        if action is None:
            action = list(next(answers).output_ids)
        mask = [1] * len(action)
        if not action or action[-1] != eos:
            action, mask = action + [eos], mask + [0]
        source = episode.sample
        samples.append(Sample(
            prompt_ids=source.prompt_ids + source.response_ids[:turn.start], response_ids=action,
            rollout_log_probs=[0.0] * len(action), loss_mask=mask,
            executors=[int(Executor.TEACHER) if m else int(Executor.ENVIRONMENT) for m in mask],
            group_index=source.group_index, finish_reason="stop", weight_version=source.weight_version,
            label=source.label, reward=source.reward, reward_error=source.reward_error,
            metadata={**source.metadata, "relabeled_turn_executor": turn.executor.name.lower()},
        ))
    for sample in samples:
        sample.response_text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return samples


def rollin_metrics(spec: RollInSpec, episodes: Sequence[Episode], iteration: int) -> dict[str, float]:
    """rollin/teacher_turn_frac, rollin/teacher_token_frac (of action tokens), and beta or T_max / kappa."""
    turns = [t for e in episodes for t in e.turns]
    teacher_tokens = sum(sum(1 for x in e.sample.executors if x == Executor.TEACHER) for e in episodes)
    action_tokens = sum(sum(1 for x in e.sample.executors if x != Executor.ENVIRONMENT) for e in episodes)
    metrics = {
        "rollin/teacher_turn_frac": sum(t.executor == Executor.TEACHER for t in turns) / max(1, len(turns)),
        "rollin/teacher_token_frac": teacher_tokens / max(1, action_tokens),
        "rollin/turns_mean": len(turns) / max(1, len(episodes)),
    }
    if isinstance(spec.roll_in, BetaMixtureRollIn):
        metrics["rollin/beta"] = spec.roll_in.schedule(iteration)
    if isinstance(spec.roll_in, AggreVaTeRollIn):
        metrics["rollin/t_max"] = float(spec.roll_in.schedule(iteration))
        metrics["rollin/kappa_mean"] = sum(e.kappa for e in episodes) / max(1, len(episodes))
    return metrics
