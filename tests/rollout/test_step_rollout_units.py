"""Driver-side rollout pieces without Ray or models: roll-in resolution and turn execution with
scripted engines, online-DAgger relabeling, DAPO's overlong penalty and dynamic sampling in
`StepRollout`, rollout dumps, and the multi-engine pool's spreading."""

from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.rollout import rollin
from stacx.rollout.data import Example
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.recipes import get_recipe
from stacx.wire.sample import Executor
from stacx.wire.types import GenerateOutput

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


def _ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers every request with the same action text (+ eos); records what it was asked."""

    def __init__(self, action: str, *, log_prob: float = -0.5, version: int = 3, delay_s: float = 0.0):
        self.action_ids = _ids(action) + [EOS]
        self.log_prob, self.version, self.delay_s = log_prob, version, delay_s
        self.requests = []
        self.lock = threading.Lock()

    def generate(self, requests):
        time.sleep(self.delay_s)
        with self.lock:
            self.requests += list(requests)
        return [GenerateOutput(output_ids=list(self.action_ids), output_log_probs=[self.log_prob] * len(self.action_ids),
                               finish_reason="stop", weight_version=self.version) for _ in requests]

    def weight_version(self):
        return self.version

    def shutdown(self):
        pass


def _turn_segments(sample) -> list[tuple[int, list[int]]]:
    """(executor, tokens) of each action (maximal run of non-environment executors)."""
    segments, current = [], None
    for token, executor in zip(sample.response_ids, sample.executors):
        if executor == Executor.ENVIRONMENT:
            current = None
            continue
        if current is None:
            current = (executor, [])
            segments.append(current)
        current[1].append(token)
    return segments


def protocol_of(recipe: str):
    return get_recipe(recipe).rollin_protocol


def test_rollin_mode_comes_from_the_recipe_unless_overridden():
    teacher = RunConfig().teacher
    assert rollin.resolve_rollin(protocol_of("grpo"), teacher).mode == "student"
    assert rollin.resolve_rollin(protocol_of("mixture_dagger_opd"), teacher).mode == "beta"
    assert rollin.resolve_rollin(protocol_of("mixture_aggrevate_opd"), teacher).mode == "kappa"
    assert rollin.resolve_rollin(protocol_of("online_dagger"), teacher).mode == "relabel"
    # STACX_DAGGER_SAMPLING_MODE swaps the protocol of a mixture recipe; STACX_DAGGER_SFT_MODE selects replay.
    swapped = rollin.resolve_rollin(protocol_of("mixture_dagger_opd"), teacher, {"STACX_DAGGER_SAMPLING_MODE": "kappa"})
    assert swapped.mode == "kappa" and swapped.roll_in.schedule(1) == 20
    assert rollin.resolve_rollin(protocol_of("mixture_aggrevate_opd"), teacher,
                                 {"STACX_DAGGER_SAMPLING_MODE": "mixture_dagger_opd"}).mode == "beta"
    assert rollin.resolve_rollin(protocol_of("online_dagger"), teacher, {"STACX_DAGGER_SFT_MODE": "trajectory"}) is None
    # A value the user set (RunConfig.given_keys records it) also wins over the recipe.
    explicit = RunConfig.from_dict({"dagger_sampling_mode": "kappa"})
    assert rollin.resolve_rollin(protocol_of("mixture_dagger_opd"), explicit.teacher,
                                 given_keys=explicit.given_keys).mode == "kappa"
    with pytest.raises(ValueError, match="STACX_DAGGER_SAMPLING_MODE"):
        rollin.resolve_rollin(protocol_of("mixture_dagger_opd"), teacher, {"STACX_DAGGER_SAMPLING_MODE": "delta"})


def test_aggrevate_turns_follow_kappa_in_a_multi_turn_environment():
    from stacx.rollout.dagger import AggreVaTeRollIn, TMaxSchedule
    from stacx.wire.types import SamplingParams

    spec = rollin.RollInSpec("kappa", AggreVaTeRollIn(TMaxSchedule(start=1, step=1, cap=4)))
    # target 9: "3" (student) is answered "higher", "7" (teacher) too, so every episode runs max_turns turns.
    examples = [Example(prompt_ids=[5], source=f"t:{i}", label=None,
                        metadata={"environment": "guess_number", "max_turns": 4, "target": 9}) for i in range(3)]
    student, teacher = ScriptedEngine("3"), ScriptedEngine("7", log_prob=-9.0)
    rng = random.Random(0)
    episodes = rollin.start_episodes(examples, n_samples_per_prompt=4, spec=spec, iteration=2, rng=rng,
                                     tokenizer=TOKENIZER)
    rollin.run_turns(episodes, engines={Executor.STUDENT: student, Executor.TEACHER: teacher},
                     sampling=SamplingParams(max_new_tokens=3), tokenizer=TOKENIZER, rng=rng)
    kappas = [e.kappa for e in episodes]
    assert all(0 <= k <= 3 for k in kappas) and len(set(kappas)) > 1  # T_max(2) = 3
    for episode in episodes:
        sample, kappa = episode.sample, episode.kappa
        expected = ["student"] * min(kappa, 4) + ["teacher"] * (4 - min(kappa, 4))
        assert sample.metadata["turn_executors"] == expected
        segments = _turn_segments(sample)
        assert [Executor(ex).name.lower() for ex, _ in segments] == expected
        for executor, tokens in segments:  # each action is the executing engine's own output
            assert tokens == (student if executor == Executor.STUDENT else teacher).action_ids
        for lp, ex in zip(sample.rollout_log_probs, sample.executors):
            assert lp == (-0.5 if ex == Executor.STUDENT else 0.0)
        assert sample.loss_mask == [int(ex != Executor.ENVIRONMENT) for ex in sample.executors]
        assert sample.reward == 0.0 and sample.finish_reason == "length"
    # Lock-step batching: one request per executor per turn at most.
    assert len(student.requests) == sum(min(k, 4) for k in kappas)
    assert len(teacher.requests) == sum(4 - min(k, 4) for k in kappas)
    metrics = rollin.rollin_metrics(spec, episodes, 2)
    assert metrics["rollin/t_max"] == 3 and metrics["rollin/kappa_mean"] == pytest.approx(sum(kappas) / len(kappas))
    assert metrics["rollin/teacher_turn_frac"] == pytest.approx(sum(4 - k for k in kappas) / (4 * len(kappas)))


def test_environment_ends_an_episode_when_solved_and_sums_rewards():
    from stacx.wire.types import SamplingParams

    examples = [Example(prompt_ids=[5], source="t:0", metadata={"environment": "guess_number", "max_turns": 5,
                                                                  "target": 3})]
    episodes = rollin.start_episodes(examples, n_samples_per_prompt=1, spec=rollin.RollInSpec("student"),
                                     iteration=0, rng=random.Random(0), tokenizer=TOKENIZER)
    rollin.run_turns(episodes, engines={Executor.STUDENT: ScriptedEngine("3")}, sampling=SamplingParams(),
                     tokenizer=TOKENIZER, rng=random.Random(1))
    assert episodes[0].sample.reward == 1.0 and episodes[0].sample.finish_reason == "stop"
    assert len(episodes[0].turns) == 1


def test_online_dagger_relabels_every_visited_turn_with_the_teachers_action():
    from stacx.rollout.dagger import BetaMixtureRollIn, BetaSchedule
    from stacx.wire.types import SamplingParams

    spec = rollin.RollInSpec("relabel", BetaMixtureRollIn(BetaSchedule(start=0.5, end=0.5)))
    examples = [Example(prompt_ids=[5, 6], source="t:0", metadata={"environment": "guess_number", "max_turns": 3,
                                                                     "target": 9})]
    student, teacher = ScriptedEngine("3"), ScriptedEngine("8")
    rng = random.Random(4)
    episodes = rollin.start_episodes(examples, n_samples_per_prompt=4, spec=spec, iteration=0, rng=rng,
                                     tokenizer=TOKENIZER)
    rollin.run_turns(episodes, engines={Executor.STUDENT: student, Executor.TEACHER: teacher},
                     sampling=SamplingParams(max_new_tokens=3), tokenizer=TOKENIZER, rng=rng)
    executed = [t.executor for e in episodes for t in e.turns]
    assert Executor.STUDENT in executed and Executor.TEACHER in executed  # beta = 0.5 mixes both
    teacher_calls_during_rollin = len(teacher.requests)
    samples = rollin.relabel_with_teacher(episodes, teacher_engine=teacher, sampling=SamplingParams(max_new_tokens=3),
                                          tokenizer=TOKENIZER, rng=rng)
    assert len(samples) == len(executed)
    # Only student-executed states went to the teacher for a label.
    assert len(teacher.requests) - teacher_calls_during_rollin == executed.count(Executor.STUDENT)
    index = 0
    for episode in episodes:
        for turn in episode.turns:
            sample = samples[index]
            index += 1
            assert sample.prompt_ids == episode.sample.prompt_ids + episode.sample.response_ids[:turn.start]
            assert sample.response_ids == teacher.action_ids
            assert sample.executors == [int(Executor.TEACHER)] * len(teacher.action_ids)
            assert sample.metadata["relabeled_turn_executor"] == turn.executor.name.lower()


@pytest.mark.parametrize("length,expected", [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (12, -1.0)])
def test_overlong_penalty_is_linear_in_the_buffer(length, expected):
    from stacx.rollout.step_rollout import overlong_penalty

    assert overlong_penalty(length, max_length=10, buffer_length=4, factor=1.0) == pytest.approx(expected)
    assert overlong_penalty(length, max_length=10, buffer_length=4, factor=2.0) == pytest.approx(2 * expected)
    assert overlong_penalty(length, max_length=10, buffer_length=0, factor=2.0) == 0.0


def test_overlong_buffer_longer_than_the_response_limit_is_refused():
    from stacx.rollout.step_rollout import overlong_penalty

    with pytest.raises(ValueError, match="overlong_buffer_length"):
        overlong_penalty(1, max_length=4, buffer_length=8, factor=1.0)


class FakeData:
    """A prompt source: example i has label i; `batch_size` prompts per step."""

    def __init__(self, batch_size):
        self.batch_size, self.position = batch_size, 0

    def next_examples(self, count=None):
        count = self.batch_size if count is None else count
        out = [Example(prompt_ids=[5 + (self.position + i) % 20], source="fake", label=self.position + i)
               for i in range(count)]
        self.position += count
        return out


def test_dynamic_sampling_keeps_informative_groups_and_dumps_rollouts(tmp_path):
    """Prompts with an even label get equal rewards in their group (dropped); odd ones differ (kept)."""
    from stacx.rollout.manager import RolloutManager
    from stacx.rollout.step_rollout import StepRollout

    counter = iter(range(1, 1000))
    lock = threading.Lock()

    def reward(response, label, metadata):
        with lock:  # rewards run in a thread pool
            return 0.0 if label % 2 == 0 else float(next(counter))

    class Service:
        tokenizer = TOKENIZER
        engine = ScriptedEngine("12")

        def manager(self, step, **_):
            return RolloutManager(self.engine, tokenizer=TOKENIZER, reward_fn=reward, seed=step)

        def sampling_params(self):
            from stacx.wire.types import SamplingParams

            return SamplingParams(max_new_tokens=4)

    run_config = RunConfig.from_dict({"rollout_batch_size": 3, "n_samples_per_prompt": 2, "over_sampling_factor": 1.0,
                                      "rollout_max_response_len": 4, "save_rollouts_per_step": 100,
                                      "out": str(tmp_path)})
    algorithm = AlgorithmConfig(filter_zero_variance_groups=True, overlong_buffer_length=2, overlong_penalty_factor=1.0)
    data = FakeData(batch_size=3)
    step_rollout = StepRollout(Service(), data, rollout=run_config.rollout,
                               plan=rollout_plan(get_recipe("dapo"), run_config),
                               out_dir=run_config.logging.out, algorithm=algorithm)
    samples, metrics = step_rollout.collect(step=0)
    # Round 1 draws labels 0,1,2 (keeps 1); round 2 draws 3,4 (keeps 3); round 3 draws 5 (keeps 5).
    assert [s.label for s in samples] == [1, 1, 3, 3, 5, 5]
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert metrics["rollout/dynamic_groups_drawn"] == 6 and metrics["rollout/dynamic_groups_dropped"] == 3
    assert metrics["rollout/dynamic_groups_kept"] == 3 and metrics["rollout/dynamic_rounds"] == 3
    assert metrics["rollout/dynamic_groups_surplus"] == 0
    # The scripted response "12<eos>" is 3 tokens: L - B = 2 < 3 <= 4, penalty (2 - 3) / 2 = -0.5.
    assert all(s.metadata["overlong_penalty"] == -0.5 for s in samples)
    base = [s.reward + 0.5 for s in samples]
    assert all(b == int(b) and b >= 1 for b in base)  # the reward function's value, then the penalty
    with open(tmp_path / "rollouts.jsonl") as handle:
        rows = [json.loads(line) for line in handle]
    assert [r["label"] for r in rows] == [1, 1, 3, 3, 5, 5] and {r["step"] for r in rows} == {0}
    assert rows[0]["response_text"] == "12" and rows[0]["reward"] == pytest.approx(samples[0].reward)


def test_dynamic_sampling_gives_up_with_counts_when_every_group_is_uniform(tmp_path):
    from stacx.rollout.manager import RolloutManager
    from stacx.rollout.step_rollout import StepRollout

    class Service:
        tokenizer = TOKENIZER
        engine = ScriptedEngine("1")

        def manager(self, step, **_):
            return RolloutManager(self.engine, tokenizer=TOKENIZER, reward_fn=lambda r, l, m: 1.0, seed=step)

        def sampling_params(self):
            from stacx.wire.types import SamplingParams

            return SamplingParams(max_new_tokens=4)

    run_config = RunConfig.from_dict({"rollout_batch_size": 2, "n_samples_per_prompt": 2, "dynamic_sampling": True,
                                      "save_rollouts_per_step": 0, "out": str(tmp_path)})
    step_rollout = StepRollout(Service(), FakeData(2), rollout=run_config.rollout,
                               plan=rollout_plan(get_recipe("grpo"), run_config),
                               out_dir=run_config.logging.out, algorithm=AlgorithmConfig())
    with pytest.raises(RuntimeError, match="dynamic sampling: only 0 of 2 groups"):
        step_rollout.collect(step=0)


def test_eval_interval_without_eval_data_names_the_flag(tmp_path):
    from stacx.rollout.step_rollout import StepRollout

    service = SimpleNamespace(tokenizer=TOKENIZER)
    run_config = RunConfig.from_dict({"eval_interval": 2, "out": str(tmp_path)})
    with pytest.raises(ValueError, match="--eval-data"):
        StepRollout(service, FakeData(2), rollout=run_config.rollout,
                    plan=rollout_plan(get_recipe("grpo"), run_config),
                    out_dir=run_config.logging.out, algorithm=AlgorithmConfig())


def test_engine_pool_spreads_requests_and_keeps_their_order():
    from stacx.rollout.engine_pool import EnginePool, split_balanced
    from stacx.wire.types import GenerateRequest

    requests = [GenerateRequest(input_ids=tuple(range(1, 2 + i % 3))) for i in range(10)]
    chunks = split_balanced(requests, 3)
    assert sorted(i for c in chunks for i in c) == list(range(10)) and len(chunks) == 3
    assert all(c == list(range(c[0], c[-1] + 1)) for c in chunks)  # contiguous

    class EchoEngine(ScriptedEngine):
        def generate(self, requests):
            time.sleep(self.delay_s)
            with self.lock:
                self.requests += list(requests)
            return [GenerateOutput(output_ids=list(r.input_ids), weight_version=self.version) for r in requests]

    engines = [EchoEngine("1", delay_s=0.05), EchoEngine("1", delay_s=0.05)]
    pool = EnginePool(engines, names=["a", "b"])
    outputs = pool.generate(requests)
    assert [o.output_ids for o in outputs] == [list(r.input_ids) for r in requests]
    assert all(len(e.requests) > 0 for e in engines) and sum(pool.requests_sent) == 10
    # Concurrent single-request callers go to the idle engine (least loaded), not both to the first.
    before = [len(e.requests) for e in engines]
    threads = [threading.Thread(target=pool.generate, args=([requests[0]],)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(e.requests) - b for e, b in zip(engines, before)] == [1, 1]
    assert pool.weight_versions() == {"a": 3, "b": 3}


def test_engine_pool_pause_failure_resumes_the_paused_engines_and_names_every_failure():
    from stacx.rollout.engine_pool import EnginePool

    class LifecycleEngine(ScriptedEngine):
        def __init__(self, *, fail_pause=False, fail_resume=False):
            super().__init__("1")
            self.fail_pause, self.fail_resume, self.paused, self.calls = fail_pause, fail_resume, False, []

        def pause(self):
            self.calls.append("pause")
            if self.fail_pause:
                raise ConnectionError("refused")
            self.paused = True

        def resume(self):
            self.calls.append("resume")
            if self.fail_resume:
                raise ConnectionError("gone")
            self.paused = False

    engines = [LifecycleEngine(), LifecycleEngine(fail_pause=True), LifecycleEngine(), LifecycleEngine(fail_pause=True)]
    pool = EnginePool(engines, names=["a", "b", "c", "d"])
    with pytest.raises(RuntimeError, match="pausing rollout engines failed: b: refused; d: refused"):
        pool.pause()
    # Every engine was asked (no stop at the first failure); the ones that paused were resumed.
    assert [e.calls for e in engines] == [["pause", "resume"], ["pause"], ["pause", "resume"], ["pause"]]
    assert not any(e.paused for e in engines)
    # A resume that fails while undoing is reported too, next to the pause failure.
    engines = [LifecycleEngine(fail_resume=True), LifecycleEngine(fail_pause=True)]
    with pytest.raises(RuntimeError, match=r"b: refused; a \(resuming after the failed pause\): gone"):
        EnginePool(engines, names=["a", "b"]).pause()
    # All succeed: every engine paused, nothing resumed.
    engines = [LifecycleEngine(), LifecycleEngine()]
    EnginePool(engines, names=["a", "b"]).pause()
    assert [e.calls for e in engines] == [["pause"], ["pause"]] and all(e.paused for e in engines)


def test_dapo_default_buffer_longer_than_the_response_limit_names_both_flags(tmp_path):
    from stacx.rollout.step_rollout import StepRollout

    run_config = RunConfig.from_dict({"rollout_max_response_len": 64, "out": str(tmp_path)})
    algorithm = AlgorithmConfig(filter_zero_variance_groups=True, overlong_buffer_length=4096, overlong_penalty_factor=1.0)
    with pytest.raises(ValueError, match="overlong-buffer-length.*rollout-max-response-len"):
        StepRollout(SimpleNamespace(tokenizer=TOKENIZER), FakeData(2), rollout=run_config.rollout,
                    plan=rollout_plan(get_recipe("dapo"), run_config),
                    out_dir=run_config.logging.out, algorithm=algorithm)


def test_overlong_buffer_is_a_length_or_a_fraction_of_the_response_limit():
    from types import SimpleNamespace

    from stacx.trainer.recipes import get_recipe
    from stacx.trainer.config.resolve import resolve_algorithm_config
    from stacx.rollout.step_rollout import overlong_buffer_tokens
    from stacx.trainer.config.run import RunConfig

    assert overlong_buffer_tokens(AlgorithmConfig(overlong_buffer_length=None, overlong_buffer_fraction=0.2), 64) == 13
    assert overlong_buffer_tokens(AlgorithmConfig(overlong_buffer_length=5, overlong_buffer_fraction=0.2), 64) == 5
    assert overlong_buffer_tokens(AlgorithmConfig(overlong_buffer_length=None, overlong_buffer_fraction=None), 64) == 0
    # dapo's default (a fifth, as in the DAPO paper's 4096 of 20480) fits the default response limit.
    dapo = resolve_algorithm_config(get_recipe("dapo"), RunConfig())
    limit = RunConfig().rollout.rollout_max_response_len
    assert 0 < overlong_buffer_tokens(dapo, limit) <= limit
