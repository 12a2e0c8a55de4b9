"""The driver's producer for `--rollout-mode async`: a thread that keeps the engine generating while
the trainer trains, under the staleness bound of an `AsyncRolloutScheduler`.

    producer = AsyncRollout(service, data, step_rollout, rollout_section=..., start_version=step)
    producer.start()
    for step in ...:
        samples, metrics = producer.take_batch(step)       # the B oldest groups within the bound
        ... train ...
        producer.begin_update()                             # no admission; abort (partial) or drain
        ... push the weights of version step + 1 ...
        producer.publish_version(step + 1)                  # continuations first, then new prompts
    producer.close()                                        # also on Ctrl-C: aborts, joins the thread

The thread draws prompts in the data order, admits each as one group (`n_samples_per_prompt`
requests with rids) and submits it (`InferenceEngine.submit`); admission and submission happen
under `submit_lock`, which `begin_update` also takes, so every admitted group is on the engine
when an update aborts or drains it. When a group's last response arrives (an engine thread runs
the callback), its `Sample`s are built (decoded, rewarded, teacher-scored, DAPO overlong penalty)
and handed to the scheduler with each token's policy version.

A prompt row that names an environment plays its n multi-turn episodes as one unit of work
(`rollin.start_episodes` / `run_turns` on a group thread): admitted, completed and trained as a group;
an update waits for its episodes to end, so their actions all come from the admission version.

A group with a dropped member (an episode out of --episode-retries, a reward call that failed every time)
plays the next prompt of the data order under the same group id instead (`rollout/groups_replaced`,
stacx.rollout.asynchronous.group_replacement): the batch keeps its size and its admission version.

Partial rollout: `begin_update` aborts the in-flight rids; a group whose responses come back
"abort" is `interrupt`ed with them and, after `publish_version`, continued (`continuation_request`)
before any new prompt; the joined response keeps each token's behaviour log-prob and version.

Sampling seeds are tied to the prompt: prompt i of the data order (counting from the start of the
run, across epochs) with B prompts per step gets, for its sample j, the seed the synchronous
`RolloutManager` of step i // B gives its prompt i % B (`prompt_sample_seed`). So with
--max-staleness 0 (the synchronous schedule: the same prompts in the same steps) an async run
samples exactly what a sync run samples.

Engines behind (a run whose only engine died and was restarted serving its start weights): a group whose
engine call raises `EnginesBehind` is set aside with the requests of that call (`AsyncRolloutScheduler.set_aside`,
the update window opened first, so nothing is admitted meanwhile). The trainer's next weight push reaches the
restarted engine and resubmits them; a trainer waiting for a batch those groups hold gets the `EnginesBehind`
from `take_batch` and pushes the published version again (`publish_version` of that version closes the window).
The requests are sent again as they were (same seeds), so the samples are those an uninterrupted run draws.

Checkpoints (`checkpoint_state`): admission is held while the groups on the engine finish, then every
generated, untrained group is saved with its samples and admission version, so a resumed run trains
exactly the batches the uninterrupted run trains (same data, same versions, same staleness). The data
position saved is that of the oldest prompt not yet trained, with the prompts after it that were
already trained or are saved: a resumed async run skips those (a sync run resumed from it trains them,
regenerated). A checkpoint without saved groups (written before they were saved) regenerates them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, TYPE_CHECKING

import torch

from stacx.objectives.algorithm_config import AlgorithmConfig, as_algorithm_config
from stacx.rollout.asynchronous.async_scheduler import AsyncRolloutConfig, AsyncRolloutScheduler
from stacx.rollout.asynchronous.group_replacement import MAX_REPLACEMENT_ROUNDS, GroupReplacements
from stacx.rollout.continuation import continuation_request, join_outputs
from stacx.rollout.data import ExampleSource
from stacx.rollout.engine_health import EnginesBehind
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.plan import RolloutPlan
from stacx.rollout.episode_retry import EpisodeLossError, retry_failed
from stacx.rollout.rollin import has_environment, replay_episodes, run_turns, start_episodes
from stacx.rollout.sections import RolloutSection
from stacx.wire.sample import Executor, Sample
from stacx.wire.types import GenerateOutput, GenerateRequest

if TYPE_CHECKING:  # annotations only
    from stacx.rollout.service import RolloutService
    from stacx.rollout.step_rollout import StepRollout

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0
"""How long `close` waits for the producer thread after aborting its requests."""
GROUP_CALL_THREADS = 64
"""Groups whose engine call may be in flight at once (a call is one group's samples)."""
TAKE_POLL_S = 0.5
"""`take_batch` waits in slices this long, so Ctrl-C reaches the loop while it waits."""


def prompt_sample_seed(rollout_seed: int, prompt_index: int, sample: int, *, prompts_per_step: int,
                       samples_per_prompt: int) -> int:
    """The sampling seed of sample `sample` of prompt `prompt_index` (in the run's data order).

    Equal to the seed the synchronous path gives it: step s = prompt_index // B uses a RolloutManager
    seeded with rollout_seed * 100_003 + s whose counter starts at that seed * 1_000_003 and counts
    requests prompt-major, so prompt p = prompt_index % B, sample j gets
    (rollout_seed * 100_003 + s) * 1_000_003 + p * n + j."""
    step, position = divmod(prompt_index, prompts_per_step)
    return (rollout_seed * 100_003 + step) * 1_000_003 + position * samples_per_prompt + sample


def check_async_supported(rollout: RolloutSection, plan: RolloutPlan, algorithm: AlgorithmConfig | None = None, *,
                          torchrun: bool = False, engine_kind: Optional[str] = None) -> None:
    """Refuse, before anything starts, the combinations `--rollout-mode async` does not run (ValueError
    naming the flag and the fix). `engine_kind`: the resolved engine ('cpu', 'http', 'sglang')."""
    if rollout.rollout_mode != "async":
        if rollout.partial_rollout:
            raise ValueError("--partial-rollout interrupts generations at asynchronous weight updates; add "
                             "--rollout-mode async (or drop --partial-rollout)")
        return
    drop = "drop --rollout-mode async"
    if not plan.samples_rollouts:
        raise ValueError(f"--rollout-mode async overlaps generation with training, but recipe {plan.recipe!r} "
                         f"trains on a dataset and samples nothing; {drop}")
    if plan.rollin_protocol is not None:
        raise ValueError(f"--rollout-mode async does not run roll-ins yet (recipe {plan.recipe!r} lets the "
                         f"teacher act, DAgger-style); {drop}")
    if rollout.dynamic_sampling or as_algorithm_config(algorithm, "check_async_supported").filter_zero_variance_groups:
        raise ValueError("--rollout-mode async does not combine with dynamic sampling yet (--dynamic-sampling or "
                         "filter_zero_variance_groups: dropping groups would change which prompts a step trains); "
                         f"drop dynamic sampling or {drop}")
    # A torchrun job runs asynchronously with an engine in its own process (a `stacx serve` child, attached
    # servers), not one whose launcher places its servers on a Ray cluster.
    if torchrun and engine_kind is not None and resolve_engine_kind(engine_kind).launches_on_ray:
        raise ValueError(f"--rollout-mode async under torchrun needs a rollout engine in its own process: "
                         f"--rollout-engine cpu (a `stacx serve` child of rank 0) or --rollout-engine http "
                         f"--rollout-urls (running servers); this run's engine is {engine_kind!r}. Attach the "
                         f"servers with --rollout-engine http, launch on Ray (without torchrun), or {drop}")


def importance_weight_metrics(proximal: Sequence[torch.Tensor], behaviour: Sequence[torch.Tensor],
                              masks: Sequence[torch.Tensor], *, threshold: float) -> dict[str, float]:
    """Statistics of w_t = exp(log pi_prox(a_t) - log pi_behav(a_t)) over the loss tokens (per-sample
    (R_i,) tensors): `async/iw_mean`, `_std`, `_min`, `_max`, `async/iw_above_threshold_frac` (w_t > C,
    the tokens `token_tis` truncates)."""
    keep = torch.cat([m.reshape(-1) != 0 for m in masks]) if masks else torch.zeros(0, dtype=torch.bool)
    if not bool(keep.any()):
        return {}
    delta = torch.cat([(p.double() - b.double()).reshape(-1) for p, b in zip(proximal, behaviour)])[keep]
    weights = torch.exp(delta.clamp(-20.0, 20.0))
    return {"async/iw_mean": float(weights.mean()), "async/iw_std": float(weights.std(unbiased=False)),
            "async/iw_min": float(weights.min()), "async/iw_max": float(weights.max()),
            "async/iw_above_threshold_frac": float((weights > threshold).double().mean())}


@dataclass
class _Prompt:
    """What a group is admitted with: the example and its index in the run's data order."""

    index: int
    example: Any


@dataclass
class _GroupRun:
    """A group's requests on the engine and the responses so far (joined across interruptions)."""

    prompt: _Prompt
    requests: list[GenerateRequest]
    outputs: list[Optional[GenerateOutput]]
    pending: set[int] = field(default_factory=set)
    """Samples whose current request has not answered yet."""
    set_aside: list[tuple[int, GenerateRequest]] = field(default_factory=list)
    """(sample, request) of a call that found the engines behind: sent again as they are once refreshed."""


@dataclass(frozen=True)
class _EpisodesBehind:
    """An episode group's engine call found the engines behind: its prompt is played again once refreshed."""

    prompt: _Prompt
    error: EnginesBehind


class AsyncRollout:
    """The producer thread and the scheduler of one async run (driver only)."""

    def __init__(self, service: RolloutService, data: ExampleSource, step_rollout: StepRollout, *,
                 rollout_section: RolloutSection, start_version: int, resume_state: Optional[dict] = None):
        self.service = service
        self.engine = service.engine
        self.data = data
        self.step_rollout = step_rollout
        self.section = rollout_section
        self.groups_per_step = data.batch_size
        self.samples_per_group = rollout_section.n_samples_per_prompt
        self.scheduler = AsyncRolloutScheduler(AsyncRolloutConfig(
            max_staleness=rollout_section.max_staleness, groups_per_step=self.groups_per_step,
            samples_per_group=self.samples_per_group, partial_rollout=rollout_section.partial_rollout,
            start_version=start_version))
        self.submit_lock = threading.RLock()
        """Held while a group is admitted and submitted, and by `begin_update` (the scheduler's protocol); a group
        replaced by a fresh prompt is submitted under it too, from a callback the producer may run itself."""
        self._lock = threading.Lock()  # the runs and rids below (engine callbacks run on engine threads)
        self._runs: dict[int, _GroupRun] = {}
        self._in_flight: dict[str, int] = {}  # rid -> group id
        self._episode_groups: set[int] = set()  # groups of multi-turn episodes playing (their requests have no rid)
        self._episodes_ended = threading.Condition(self._lock)
        self._calls: Optional[ThreadPoolExecutor] = None
        self.group_call_threads = GROUP_CALL_THREADS
        """Groups whose engine call may be in flight at once (1: one group after the other)."""
        self._manager = service.manager(0)  # rewards and teacher scoring only: seeds are set per request
        self._sampling = service.sampling_params()
        self._rid_prefix = f"stacx-{uuid.uuid4().hex[:8]}"  # distinct from other runs on a shared server
        self._next_index = data.prompt_index
        self._pending: Optional[_Prompt] = None  # drawn, not yet admitted
        self._admitted: dict[int, int] = {}  # group id -> prompt index, admitted and not yet trained
        resume_state = resume_state or {}
        self._trained_ahead: set[int] = set(resume_state.get("trained_prompts_ahead", ()))
        """Prompt indices trained beyond the oldest untrained prompt (skipped when drawn again after a resume)."""
        self._skip = set(self._trained_ahead)
        self._restore_buffer(resume_state.get("scheduler"))
        self._error: Optional[BaseException] = None
        self._behind: Optional[EnginesBehind] = None
        """Set while groups wait for restarted engines to get the current weights (module doc)."""
        self._behind_lock = threading.Lock()  # a group set aside vs. the trainer's refresh or publish
        self.replacements = GroupReplacements(max_dropped_fraction=rollout_section.max_dropped_fraction)
        """Groups with a dropped member, replaced by fresh prompts (stacx.rollout.asynchronous.group_replacement)."""
        self._replacement_rounds: dict[int, int] = {}  # group id -> times replaced in a row
        self._thread = threading.Thread(target=self._produce, name="stacx-async-rollout", daemon=True)

    # ---- the trainer's side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def take_batch(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The samples of training step `step` (groups oldest first; `group_index` = the group's place
        in the batch) and the async/* metrics; blocks until the batch is ready. A failure of the
        producer or of an engine request is raised here."""
        batch = None
        while batch is None:
            self._raise_if_failed()
            if self.scheduler.closed:
                raise RuntimeError("the asynchronous rollout was closed while the trainer waited for a batch")
            batch = self.scheduler.take_batch(step, timeout=TAKE_POLL_S)
            behind = self._behind
            if batch is None and behind is not None:  # the trainer pushes the published version again
                raise behind
        samples = []
        with self.submit_lock:
            for position, group in enumerate(batch.groups):
                self._trained_ahead.add(self._admitted.pop(group.group_id))
                self._replacement_rounds.pop(group.group_id, None)
                for sample in group.result:
                    sample.group_index = position
                    samples.append(sample)
            self._prune_trained_ahead()
        metrics = {**batch.metrics(), **self.scheduler.metrics(), **self.replacements.take_metrics(step)}
        return samples, metrics

    def begin_update(self) -> None:
        """Open the update window; partial rollout aborts the in-flight requests (their groups are
        interrupted as they answer) and waits until no multi-turn episode runs, otherwise wait until no
        group runs."""
        with self.submit_lock:
            self.scheduler.begin_update()
            with self._lock:
                rids = list(self._in_flight)
        if self.section.partial_rollout:
            if rids:
                self.engine.abort(rids)
            drained = self._wait_until_no_episode_runs()  # episodes carry no rids: they end their turns
        else:
            drained = self.scheduler.wait_until_drained()
        if not drained:
            self._raise_if_failed()
            raise RuntimeError("the asynchronous rollout was closed during a weight update")

    def _wait_until_no_episode_runs(self) -> bool:
        """True once no episode group runs; False if the rollout was closed meanwhile."""
        with self._episodes_ended:
            while self._episode_groups and not self.scheduler.closed:
                self._episodes_ended.wait(TAKE_POLL_S)
        return not self.scheduler.closed

    def publish_version(self, version: int) -> None:
        """The engine serves `version`: admission reopens, interrupted (and set-aside) groups first. The published
        version again is the trainer's refresh of restarted engines (after `EnginesBehind` from `take_batch`): the
        window closes without a new version."""
        with self._behind_lock:
            self._behind = None  # the push reached the engines behind too
            if version == self.scheduler.policy_version:
                self.scheduler.end_update()
            else:
                self.scheduler.publish_version(version)

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(data state, async state) of a checkpoint written between steps. Admission is held until the
        groups on the engine have finished (continuations included); then the data source's state at the
        oldest untrained prompt and the async state (the `resume_state` of the resumed run): the generated,
        untrained groups (samples, admission versions, tokens per version), the run totals, and the prompts
        after the oldest untrained one that were trained already. Admission reopens before it returns."""
        self.scheduler.hold_admission()
        try:
            while not self.scheduler.wait_until_settled(timeout=TAKE_POLL_S):
                self._raise_if_failed()
                if self.scheduler.closed:
                    raise RuntimeError("the asynchronous rollout was closed while a checkpoint waited for its groups")
                if self._behind is not None:  # set-aside groups settle only after a weight push: none comes here
                    raise RuntimeError(f"a checkpoint waited for groups whose engines need the current weights: "
                                       f"{self._behind}")
            with self.submit_lock:
                self._prune_trained_ahead()
                state = self.scheduler.state_dict()
                for group in state["groups"]:
                    group["payload"] = group["payload"].index  # the example is read again from the data
                    group["result"] = [_sample_state(sample) for sample in group["result"]]
                return (self.data.state_at(self._oldest_untrained()),
                        {"trained_prompts_ahead": sorted(self._trained_ahead), "scheduler": state})
        finally:
            self.scheduler.release_admission()

    def close(self) -> None:
        """Stop admitting, abort what runs on the engine and join the thread (idempotent; discards
        the groups not yet trained: a resumed run regenerates them)."""
        self.scheduler.close()
        with self._lock:
            rids = list(self._in_flight)
        if rids:
            try:
                self.engine.abort(rids)
            except Exception:  # noqa: BLE001 - closing: the engine may already be gone
                logger.debug("aborting the asynchronous rollout's requests at close failed", exc_info=True)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the asynchronous rollout thread did not stop within %.0fs", CLOSE_TIMEOUT_S)
        if self._calls is not None:  # the aborted calls answer at once; a dead engine's time out
            self._calls.shutdown(wait=False, cancel_futures=True)

    # ---- the producer thread -----------------------------------------------------------------------

    def _produce(self) -> None:
        try:
            while self.scheduler.wait_for_work():
                with self.submit_lock:
                    continuation = self.scheduler.pop_continuation()
                    if isinstance(getattr(continuation, "state", None), _EpisodesBehind):
                        self._submit_episodes(continuation.group_id, continuation.state.prompt)
                        continue
                    if continuation is not None:
                        self._submit_continuation(continuation.group_id, continuation.state)
                        continue
                    if self._pending is None:
                        self._pending = self._draw()
                    group_id = self.scheduler.admit(self._pending)
                    if group_id is None:  # an update window opened since wait_for_work: admit it next
                        continue
                    prompt, self._pending = self._pending, None
                    self._admitted[group_id] = prompt.index
                    self._submit_group(group_id, prompt)
        except BaseException as err:  # noqa: BLE001 - handed to the trainer through take_batch
            self._fail(err)

    def _draw(self) -> _Prompt:
        while True:
            example = self.data.next_examples(1)[0]
            index, self._next_index = self._next_index, self._next_index + 1
            if index in self._skip:  # trained before the checkpoint this run resumed from
                self._skip.discard(index)
                continue
            return _Prompt(index, example)

    def _submit_group(self, group_id: int, prompt: _Prompt) -> None:
        if has_environment(prompt.example):
            self._submit_episodes(group_id, prompt)
            return
        requests = []
        for sample in range(self.samples_per_group):
            seed = prompt_sample_seed(self.section.rollout_seed, prompt.index, sample,
                                      prompts_per_step=self.groups_per_step, samples_per_prompt=self.samples_per_group)
            requests.append(GenerateRequest(input_ids=tuple(prompt.example.prompt_ids),
                                            sampling=dataclasses.replace(self._sampling, seed=seed),
                                            return_logprob=True, rid=f"{self._rid_prefix}-g{group_id}-s{sample}",
                                            return_routed_experts=self._manager.return_routed_experts))
        run = _GroupRun(prompt, requests, [None] * len(requests))
        with self._lock:
            self._runs[group_id] = run
        self._submit(group_id, run, [(sample, request) for sample, request in enumerate(requests)])

    def _submit_continuation(self, group_id: int, run: _GroupRun) -> None:
        """An interrupted group's aborted responses continued from their tokens, and a set-aside call's requests
        sent again as they were."""
        resubmit, run.set_aside = list(run.set_aside), []
        waiting = {sample for sample, _ in resubmit}
        resubmit += [(sample, continuation_request(run.requests[sample], output))
                     for sample, output in enumerate(run.outputs)
                     if sample not in waiting and _resumable(output, run.requests[sample])]
        self._submit(group_id, run, sorted(resubmit, key=lambda pair: pair[0]))

    def _submit(self, group_id: int, run: _GroupRun, requests: list[tuple[int, GenerateRequest]]) -> None:
        with self._lock:
            for sample, request in requests:
                run.pending.add(sample)
                self._in_flight[request.rid] = group_id
        # One engine call per group: its samples decode in one batch (a server merges the concurrent
        # calls of several groups), and each keeps its own rid, so `abort` still reaches it alone.
        samples, batch = [sample for sample, _ in requests], [request for _, request in requests]
        future = self._group_calls().submit(self.engine.generate, batch)
        future.add_done_callback(lambda f, g=group_id: self._on_outputs(g, samples, batch, f))

    def _submit_episodes(self, group_id: int, prompt: _Prompt) -> None:
        """A prompt row that names an environment: its n episodes are one unit of work, played turn by
        turn on a group thread (each turn one engine call for the episodes still running). Its requests
        carry no rid: an update waits for the episodes to end (with partial rollout too), so each
        episode's actions come from the weights it was admitted under."""
        with self._lock:
            self._episode_groups.add(group_id)
        future = self._group_calls().submit(self._play_episodes, prompt, group_id)
        future.add_done_callback(lambda f, g=group_id: self._on_episodes(g, f))

    def _play_episodes(self, prompt: _Prompt, group_id: int) -> tuple[list[Sample], list[list[int]]]:
        """(samples, each sample's per-action-token versions) of a prompt's n episodes. The episodes'
        randomness (the environment's reset, each turn's seed) comes from the prompt's first sample
        seed, so a prompt plays the same episodes whenever it is drawn. An episode still failing for an
        infrastructure reason after its retries drops the group: a fresh prompt's episodes are played instead."""
        rng = random.Random(prompt_sample_seed(self.section.rollout_seed, prompt.index, 0,
                                               prompts_per_step=self.groups_per_step,
                                               samples_per_prompt=self.samples_per_group))
        tokenizer = self.service.tokenizer
        episodes = start_episodes([prompt.example], n_samples_per_prompt=self.samples_per_group,
                                  spec=self.step_rollout.spec, iteration=0, rng=rng, tokenizer=tokenizer)
        try:
            run_turns(episodes, engines={Executor.STUDENT: self.engine}, sampling=self._sampling, tokenizer=tokenizer,
                      rng=rng)
            episodes = self._retry_failed(prompt, episodes, rng)
        except EnginesBehind as behind:  # played again from the prompt once the engines are refreshed
            return _EpisodesBehind(prompt, behind)
        failures = [episode.failure for episode in episodes if episode.failure]
        if self.replacements.played([episode.sample for episode in episodes], failures):
            return self._play_episodes(self._fresh_prompt(group_id, prompt, failures), group_id)
        samples, versions = [], []
        for episode in episodes:
            sample = episode.sample
            sample.weight_version = min(episode.student_versions, default=0)
            per_token = [0] * len(sample.response_ids)
            for turn, version in zip(episode.turns, episode.student_versions):
                per_token[turn.start:turn.end] = [version] * (turn.end - turn.start)
            sample.metadata.update(prompt_index=prompt.index, token_versions=per_token)
            versions.append([v for v, m in zip(per_token, sample.loss_mask) if m])  # the tokens a version sampled
            samples.append(sample)
        self._manager.decode(samples)  # rewards: the sum of the environment's step rewards, already in place
        self._manager.score_with_teacher(samples)
        self.step_rollout.apply_overlong_penalty(samples)
        return samples, versions

    def _retry_failed(self, prompt: _Prompt, episodes: list, rng: random.Random) -> list:
        """Episodes failed for an infrastructure reason played again (--episode-retries); one still failing
        keeps its `failure` (its group is replaced by a fresh prompt's, `_play_episodes`)."""
        episodes, _ = retry_failed(episodes, failure=lambda e: e.failure, retries=self.section.episode_retries,
                                   replay=lambda failed: replay_episodes(
                                       failed, spec=self.step_rollout.spec, iteration=0,
                                       engines={Executor.STUDENT: self.engine}, sampling=self._sampling,
                                       tokenizer=self.service.tokenizer, rng=rng))
        return episodes

    def _fresh_prompt(self, group_id: int, dropped: _Prompt, reasons: Sequence[str]) -> _Prompt:
        """The next prompt of the data order, now group `group_id`'s instead of `dropped` (a member was dropped:
        `reasons`); the dropped prompt counts as consumed. `EpisodeLossError` after MAX_REPLACEMENT_ROUNDS."""
        with self.submit_lock:
            rounds = self._replacement_rounds.get(group_id, 0) + 1
            if rounds > MAX_REPLACEMENT_ROUNDS:
                raise EpisodeLossError(f"prompt row {dropped.example.source}: a group lost an episode {rounds} times in "
                                       f"a row, each time replaced by a fresh prompt; last causes: {'; '.join(reasons[:3])}. "
                                       "Fix what fails (the sandbox server, the reward service) or raise --episode-retries")
            self._replacement_rounds[group_id] = rounds
            self.replacements.replaced()
            fresh = self._draw()
            self._admitted[group_id] = fresh.index
            self._trained_ahead.add(dropped.index)  # consumed: a resumed run does not draw it again
        logger.warning("async rollout: prompt row %s lost an episode (%s); its group plays the fresh prompt row %s",
                       dropped.example.source, reasons[0], fresh.example.source)
        return fresh

    def _on_episodes(self, group_id: int, future: Future) -> None:
        try:
            result = future.result()
            if isinstance(result, _EpisodesBehind):
                self._set_aside(group_id, result, result.error)
                return
            samples, versions = result
            if not self.scheduler.closed:
                self.scheduler.complete(group_id, samples, versions)
        except BaseException as err:  # noqa: BLE001 - handed to the trainer through take_batch
            if not self.scheduler.closed:
                self._fail(err)
        finally:
            with self._episodes_ended:
                self._episode_groups.discard(group_id)
                self._episodes_ended.notify_all()

    def _group_calls(self) -> ThreadPoolExecutor:
        """The threads that wait on the engine, one call per group in flight."""
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=self.group_call_threads,
                                             thread_name_prefix="stacx-async-group")
        return self._calls

    def _on_outputs(self, group_id: int, samples: list[int], requests: list[GenerateRequest], future: Future) -> None:
        """Engine thread: a group's call answered; complete the group, or interrupt it when aborted (set it
        aside when the engines are behind the pool's weights)."""
        try:
            try:
                outputs = future.result()
            except EnginesBehind as behind:
                with self._lock:
                    run = self._runs[group_id]
                    for sample, request in zip(samples, requests):
                        self._in_flight.pop(request.rid, None)
                        run.pending.discard(sample)
                        run.set_aside.append((sample, request))
                    if run.pending:
                        return
                self._set_aside(group_id, run, behind)
                return
            with self._lock:
                run = self._runs[group_id]
                for sample, request, output in zip(samples, requests, outputs):
                    self._in_flight.pop(request.rid, None)
                    so_far = run.outputs[sample]
                    run.outputs[sample] = join_outputs(so_far, output) if so_far is not None else output
                    run.pending.discard(sample)
                if run.pending:
                    return
                interrupted = any(_resumable(o, r) for o, r in zip(run.outputs, run.requests))
            if self.scheduler.closed:
                return
            if interrupted:
                self.scheduler.interrupt(group_id, run)
                return
            samples = self._build_samples(run)
            reasons = self.replacements.played(samples)
            if reasons:  # a reward call failed every time: the group plays a fresh prompt instead
                with self.submit_lock:
                    self._submit_group(group_id, self._fresh_prompt(group_id, run.prompt, reasons))
                return
            with self._lock:
                del self._runs[group_id]
            self.scheduler.complete(group_id, samples, [o.output_token_versions for o in run.outputs])
        except BaseException as err:  # noqa: BLE001 - handed to the trainer through take_batch
            if not self.scheduler.closed:
                self._fail(err)

    def _set_aside(self, group_id: int, state: Any, behind: EnginesBehind) -> None:
        """Group `group_id` waits for the engines to get the current weights (module doc). An error raised before
        a push that has since brought the engines up to date (they serve now) only sends the group again."""
        with self._behind_lock:
            if self.scheduler.closed:
                return
            supervisor = getattr(self.engine, "supervisor", None)
            if supervisor is not None and supervisor.serving():
                self.scheduler.set_aside(group_id, state)  # continued at once: the window is not opened
                return
            if self._behind is None:
                logger.warning("async rollout: %s; the groups on it wait for the trainer's weight push", behind)
            self.scheduler.begin_update()  # first: nothing is admitted or continued before the refresh
            self.scheduler.set_aside(group_id, state)
            self._behind = behind  # last: the trainer refreshes only once the group waits

    def _build_samples(self, run: _GroupRun) -> list[Sample]:
        example = run.prompt.example
        samples = []
        for request, output in zip(run.requests, run.outputs):
            if output.finish_reason == "abort":  # aborted with its budget used up: it ran to the length limit
                output = dataclasses.replace(output, finish_reason="length")
            samples.append(Sample(
                prompt_ids=list(request.input_ids), response_ids=list(output.output_ids),
                rollout_log_probs=list(output.output_log_probs), loss_mask=[1] * len(output.output_ids),
                executors=[int(Executor.STUDENT)] * len(output.output_ids), group_index=0,
                finish_reason=output.finish_reason, weight_version=output.weight_version, label=example.label,
                metadata={**(example.metadata or {}), "prompt_index": run.prompt.index,
                          "token_versions": list(output.output_token_versions)},
                routed_experts=output.routed_experts,
            ))
        self._manager.decode(samples)
        self._manager.score_rewards(samples)
        self._manager.score_with_teacher(samples)
        self.step_rollout.apply_overlong_penalty(samples)
        return samples

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _restore_buffer(self, state: Optional[dict]) -> None:
        """Put a checkpoint's generated, untrained groups back as complete, oldest first (before start)."""
        if not state:
            return
        sizes = sorted({len(group["result"]) for group in state["groups"]})
        if sizes and sizes != [self.samples_per_group]:
            raise ValueError(f"the checkpoint holds generated, untrained groups of {sizes} samples per prompt but this "
                             f"run has --n-samples-per-prompt {self.samples_per_group}; resume with the "
                             "--n-samples-per-prompt the checkpoint was written with")
        state = {**state, "groups": [{**group, "payload": _Prompt(int(group["payload"]), None),
                                      "result": [Sample(**fields) for fields in group["result"]]}
                                     for group in state["groups"]]}
        for group_id, group in zip(self.scheduler.load_state_dict(state), state["groups"]):
            self._admitted[group_id] = group["payload"].index
            self._skip.add(group["payload"].index)  # generated already: not drawn again

    def _oldest_untrained(self) -> int:
        """Index of the oldest prompt drawn and not trained (or the next one to draw); under submit_lock."""
        next_index = self._next_index
        while next_index in self._skip:  # trained before the checkpoint this run resumed from
            next_index += 1
        candidates = [next_index, *self._admitted.values()]
        if self._pending is not None:
            candidates.append(self._pending.index)
        return min(candidates)

    def _prune_trained_ahead(self) -> None:
        oldest = self._oldest_untrained()
        self._trained_ahead = {index for index in self._trained_ahead if index > oldest}

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
            logger.error("the asynchronous rollout failed: %s", err)
        self.scheduler.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the asynchronous rollout failed: {self._error}") from self._error


def _sample_state(sample: Sample) -> dict:
    """A `Sample` as plain fields (lists, numbers, strings, tensors) for a checkpoint's driver state."""
    return {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}


def _resumable(output: Optional[GenerateOutput], request: GenerateRequest) -> bool:
    """An aborted response with budget left (one that used its whole budget is complete)."""
    return (output is not None and output.finish_reason == "abort"
            and len(output.output_ids) < request.sampling.max_new_tokens)
